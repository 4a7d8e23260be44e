"""``torch.distributed.pipelining`` stages: a ``forward``/``backward`` span per microbatch, with attrs
``microbatch`` (and ``chunk`` with virtual stages, ``stage``). The schedule's send/recv go through
``batch_isend_irecv``, which the recorder already sees; these are the compute spans between them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from otel_train import api, phases
from otel_train import schema as S

_MARK = "__otel_train_original__"


def _attrs(stage: Any, chunk_id: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {S.ATTR_MICROBATCH: int(chunk_id)}
    try:
        index, stages, size = int(stage.stage_index), int(stage.num_stages), int(stage.group_size)
        attrs["stage"] = index
        if stages > size:  # more stages than ranks: virtual stages, this one is chunk index // size
            attrs[S.ATTR_CHUNK] = index // size
    except Exception:  # noqa: BLE001 - a stage without these fields: the microbatch is what matters
        pass
    return attrs


def _wrap(original: Callable[..., Any], phase: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def one_chunk(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if api._tracing is None:
            return original(self, chunk_id, *args, **kwargs)
        with api.log_trace_span(phase, **_attrs(self, chunk_id)):
            return original(self, chunk_id, *args, **kwargs)

    setattr(one_chunk, _MARK, original)
    return one_chunk


def install() -> Callable[[], None]:
    """Wrap ``_PipelineStageBase.forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
    (once per process); returns the undo."""
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    done = []
    for name, phase in (("forward_one_chunk", phases.FORWARD), ("backward_one_chunk", phases.BACKWARD),
                        ("backward_weight_one_chunk", phases.BACKWARD)):
        original = getattr(Stage, name, None)
        if original is None or hasattr(original, _MARK):
            continue
        wrapper = _wrap(original, phase)
        setattr(Stage, name, wrapper)
        done.append((name, original, wrapper))

    def undo() -> None:
        for name, original, wrapper in done:
            if getattr(Stage, name, None) is wrapper:
                setattr(Stage, name, original)

    return undo
