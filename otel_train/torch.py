"""Plain-PyTorch integration: data, batch-to-device, forward, backward and optimizer spans.

Use inside ``ot.training_step(step)`` so each phase nests under its step::

    import otel_train as ot
    from otel_train import torch as ott

    handle = ott.instrument(model, optimizer)        # forward + optimizer spans
    batches = iter(ott.traced(loader))               # each next() is a data_fetch span
    for step in range(num_steps):
        with ot.training_step(step):
            batch = next(batches)
            batch = ott.batch_to_device(batch, device)
            loss = loss_fn(model(batch))
            ott.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    handle.remove()

Nothing here synchronizes a device, reads tensor data or instruments DataLoader worker processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

import otel_train as ot
from otel_train import integration_spans, _report, context, phases, runtime

__all__ = ["Handle", "TracedIterable", "backward", "batch_to_device", "instrument", "instrument_pipeline", "traced"]


class _TracedIterator:
    """Wraps a (DataLoader) iterator: each ``next()`` is a ``data_fetch`` span, plus batch stats."""

    __slots__ = ("_it", "_every", "_fetches")

    def __init__(self, it: Iterator[Any], every: int) -> None:
        self._it = it
        self._every = every
        self._fetches = 0

    def __iter__(self) -> _TracedIterator:
        return self

    def __next__(self) -> Any:
        span = integration_spans.HeldSpan(phases.DATA_FETCH)
        try:
            batch = next(self._it)
        except StopIteration:
            # The end of an epoch is not an error: end the span normally, then stop.
            span.end()
            raise
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()
        if self._every:
            step = context.current_step()
            index = self._fetches if step is None else step
            self._fetches += 1
            if index % self._every == 0:
                integration_spans.log_batch_stats(batch)
        return batch

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class TracedIterable:
    """An iterable whose iterators trace each fetch; ``len()`` and other attributes pass through."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._iterable = iterable

    def __iter__(self) -> _TracedIterator:
        settings = runtime.current_settings()
        every = settings.batch_stats_every if settings is not None else 0
        # iter() starts DataLoader workers: they run the dataset, never this wrapper.
        return _TracedIterator(iter(self._iterable), every)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # dataset, sampler, batch_size, ... of a DataLoader; `_iterable` itself may not exist yet
        # while unpickling, so don't recurse through __getattr__ for it.
        if name == "_iterable":
            raise AttributeError(name)
        return getattr(self._iterable, name)


def traced(loader: Iterable[Any]) -> TracedIterable:
    """Trace every fetch from ``loader`` (a DataLoader or any iterable) as a ``data_fetch`` span.

    Every ``batch_stats_every`` steps the shapes of the fetched batch are recorded as scalars
    (``batch_size``, ``input<i>.numel``, ``input<i>.dim<j>``). Fetch inside ``ot.training_step`` (call
    ``next()`` on ``iter(traced(loader))``) for the span to nest under its step.
    """
    return TracedIterable(loader)


class _Undo:
    """An uninstaller with the ``remove()`` of the other hooks."""

    def __init__(self, undo: Any) -> None:
        self._undo = undo

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


class Handle:
    """Hooks installed by :func:`instrument`; ``remove()`` uninstalls them."""

    def __init__(self, hooks: list[Any]) -> None:
        self._hooks = hooks

    def remove(self) -> None:
        """Remove every hook this handle installed (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _recording_comm() -> bool:
    settings = runtime.current_settings()
    return settings is not None and settings.collectives != "off"


def _ddp_of(model: Any) -> Any:
    """The DistributedDataParallel inside ``model`` (itself, or the module a ``torch.compile`` wraps)."""
    from torch.nn.parallel import DistributedDataParallel

    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def instrument_pipeline() -> Handle:
    """A ``forward``/``backward`` span per microbatch of every ``torch.distributed.pipelining`` stage,
    with attrs ``microbatch`` (and ``chunk`` with virtual stages, ``stage``): docs/comm.md."""
    from otel_train.comm import pipelining

    return Handle([_Undo(pipelining.install())])


def instrument(model: Any = None, optimizer: torch.optim.Optimizer | None = None) -> Handle:
    """A ``forward`` span per call of ``model`` and an ``optimizer`` span per ``optimizer.step()``.

    ``model`` may be a DDP wrapper or a ``torch.compile``-d module: instrument the object you call.
    With ``collectives`` recording on, a DDP model also gets a comm hook that issues its bucket
    all-reduces through ``torch.distributed`` (the same arithmetic as DDP's default), so each one is
    a ``comm.all_reduce`` span with host times (docs/comm.md). A pipeline stage or schedule
    (``torch.distributed.pipelining``) gets microbatch spans instead (:func:`instrument_pipeline`).
    """
    hooks: list[Any] = []
    if model is not None and _is_pipeline(model):
        hooks.extend(instrument_pipeline()._hooks)
    elif model is not None:
        hooks.append(integration_spans.ForwardSpans(model))
        ddp = _ddp_of(model) if _recording_comm() else None
        if ddp is not None:
            from otel_train.comm import ddp as ddp_hook

            try:
                ddp_hook.install(ddp)
            except Exception as exc:  # noqa: BLE001 - DDP then runs as it would without us
                _report.report_exception("installing the DDP comm hook (bucket all-reduces may be missing)", exc)
    if optimizer is not None:
        hooks.append(integration_spans.OptimizerSpans(optimizer))
    return Handle(hooks)


def _is_pipeline(model: Any) -> bool:
    module = type(model).__module__
    return module.startswith("torch.distributed.pipelining")


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward(**kwargs)`` inside a ``backward`` span (under DDP it includes the all-reduce)."""
    with ot.log_trace_span(phases.BACKWARD):
        loss.backward(**kwargs)


def _move(obj: Any, device: torch.device | str, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        moved = {k: _move(v, device, non_blocking) for k, v in obj.items()}
        try:
            return type(obj)(moved)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that can't be built from a dict (defaultdict, ...)
            return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_move(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, non_blocking) for v in obj)
    if hasattr(obj, "to") and callable(obj.to):  # e.g. transformers.BatchEncoding
        return obj.to(device)
    return obj


def batch_to_device(batch: Any, device: torch.device | str, *, non_blocking: bool = False) -> Any:
    """Move the tensors of a nested batch (dicts, lists, tuples, namedtuples) to ``device`` inside a
    ``batch_to_device`` span; returns the moved batch. With ``non_blocking=True`` the span measures the
    enqueue, not the copy (nothing here waits for the device)."""
    with ot.log_trace_span(phases.BATCH_TO_DEVICE):
        return _move(batch, device, non_blocking)
