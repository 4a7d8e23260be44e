"""Framework-neutral pieces shared by the torch, Lightning and Transformers integrations.

Nothing here imports torch at import time: ``torch`` is looked up in ``sys.modules`` or imported
lazily when a module or optimizer (which can only exist once torch is imported) is instrumented.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import Any, Callable

from otel_train import _report, api, phases

# A bounded walk: a pathological batch (a list of 100k tensors) must not cost more than a few µs.
_MAX_VISITED = 64
_MAX_DIMS = 8


def _shape_of(obj: Any) -> tuple[int, ...] | None:
    """The shape of a tensor-like (torch, numpy, ...) as Python ints, or None for anything else."""
    shape = getattr(obj, "shape", None)
    if shape is None or isinstance(obj, type):
        return None
    try:
        # Shapes are host-side metadata: reading them never touches data or syncs a device.
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def _tensor_shapes(batch: Any, limit: int) -> list[tuple[int, ...]]:
    """Shapes of the first ``limit`` tensor-likes found breadth-first in nested tuples/lists/dicts."""
    found: list[tuple[int, ...]] = []
    queue = [batch]
    visited = 0
    while queue and len(found) < limit and visited < _MAX_VISITED:
        obj = queue.pop(0)
        visited += 1
        shape = _shape_of(obj)
        if shape is not None:
            found.append(shape)
        elif isinstance(obj, Mapping):
            queue.extend(obj.values())
        elif isinstance(obj, (tuple, list)):
            queue.extend(obj)
    return found


def batch_stats(batch: Any, *, max_tensors: int = 4) -> dict[str, int]:
    """Rank-local statistics of a batch, from tensor shapes only.

    ``batch_size`` is the first dimension of the first tensor-like with at least one dimension;
    ``input<i>.numel`` and ``input<i>.dim<j>`` describe the first ``max_tensors`` tensor-likes found in
    nested tuples, lists and dicts. Never reads tensor data, never calls ``.item()``, never syncs.
    """
    stats: dict[str, int] = {}
    for i, shape in enumerate(_tensor_shapes(batch, max_tensors)):
        if shape and "batch_size" not in stats:
            stats["batch_size"] = shape[0]
        numel = 1
        for d in shape:
            numel *= d
        stats[f"input{i}.numel"] = numel
        for j, d in enumerate(shape[:_MAX_DIMS]):
            stats[f"input{i}.dim{j}"] = d
    return stats


def log_batch_stats(batch: Any) -> None:
    """Record ``batch_stats(batch)`` as scalars (nothing for a batch without tensor-likes)."""
    stats = batch_stats(batch)
    if stats:
        api.log_trace_scalar(stats)


class HeldSpan:
    """A span opened now and ended later, outside a ``with`` block (by hooks, callbacks, iterators).

    It must be ended on the thread (and in the context) that opened it, like any ``with`` block.
    """

    __slots__ = ("_span",)

    def __init__(self, name: str, attrs: Mapping[str, Any] | None = None) -> None:
        self._span = api.log_trace_span(name, **attrs) if attrs else api.log_trace_span(name)
        self._span.__enter__()

    @classmethod
    def step(cls, step: int, *, epoch: int | None = None, iteration: int | None = None) -> HeldSpan:
        """``ot.training_step(...)``, held open: sets the step and opens its ``step`` span."""
        api.set_step(step, epoch=epoch, iteration=iteration)
        return cls(phases.STEP)

    def end(self, exc: BaseException | None = None) -> None:
        """End the span; with ``exc`` it ends as error with that exception (which is not raised)."""
        if exc is None:
            self._span.__exit__(None, None, None)
        else:
            self._span.__exit__(type(exc), exc, exc.__traceback__)


class FirstFailureGuard:
    """Runs an integration's tracing calls: tracing must never break training, so a failure is
    reported once per integration and exception type (``otel_train._report``) and counted."""

    def __init__(self, integration: str) -> None:
        self._where = f"otel_train.{integration} tracing (spans may be missing)"

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            _report.report_exception(self._where, exc)


def is_compiling() -> bool:
    """Whether the caller is being traced by ``torch.compile`` (False when torch isn't imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


class _SpanStack(threading.local):
    """Spans opened by a pre-hook and closed by the matching post-hook, per thread (they must be
    exited on the thread they were entered on)."""

    def __init__(self) -> None:
        self.open: list[HeldSpan] = []


class _HookSpans:
    """Opens a span in a pre-hook and ends it in the post-hook.

    Hooks return at once while dynamo traces them, so inside a compiled region they are no-ops: no
    graph break, ``fullgraph=True`` keeps working, and dynamo never reaches otel code. (They are not
    wrapped in ``torch.compiler.disable``: that wrapper costs more per call than the span itself, and
    the ``is_compiling`` guard already keeps dynamo out.)"""

    def __init__(self, name: str) -> None:
        import torch

        self._name = name
        self._stack = _SpanStack()
        self._is_compiling: Callable[[], bool] = torch.compiler.is_compiling
        self._handles: list[Any] = []

    def _open(self) -> None:
        self._stack.open.append(HeldSpan(self._name))

    def _close(self, maybe_failed: bool = False) -> None:
        if self._stack.open:
            # An always_call forward hook runs with no output inside torch's ``except`` block while
            # the forward's exception propagates: end the span as error with that exception.
            self._stack.open.pop().end(sys.exc_info()[1] if maybe_failed else None)

    def remove(self) -> None:
        """Unregister the hooks (spans already open are left to their post-hook or to shutdown)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ForwardSpans(_HookSpans):
    """A ``forward`` span around every call of a root ``nn.Module`` (forward pre/post hooks)."""

    def __init__(self, module: Any) -> None:
        super().__init__(phases.FORWARD)
        self._handles = [
            module.register_forward_pre_hook(self._pre),
            # always_call: an exception in forward still ends the span (as error).
            module.register_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: Any, args: Any) -> None:
        if self._is_compiling():
            return
        self._open()

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if self._is_compiling():
            return
        self._close(output is None)


class OptimizerSpans(_HookSpans):
    """An ``optimizer`` span around every ``optimizer.step()`` (step pre/post hooks).

    If ``step()`` raises, the post-hook does not run: the span stays open and ``shutdown`` ends it as
    incomplete, which is what a crashed run should show. A later ``step()`` drops the stale entry."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(phases.OPTIMIZER)
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling():
            return
        self._stack.open.clear()
        self._open()

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling():
            return
        self._close()
