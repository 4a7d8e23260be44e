"""Training context (step, epoch, iteration, tags) carried by every record.

The current :class:`StepState` lives in a ContextVar, so an asyncio task or a thread started with a
copied context keeps the step it was started in. A thread started with an empty context (the default
for ``threading.Thread``) sees the latest step set anywhere in the process. Knows nothing of OTel.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Callable


class StepState:
    """An immutable snapshot of the training context; a new one is made whenever it changes."""

    __slots__ = ("step", "relative_step", "epoch", "iteration", "tags", "sink_cache")

    def __init__(
        self,
        step: int | None,
        relative_step: int | None,
        epoch: int | None,
        iteration: int | None,
        tags: tuple[str, ...],
    ) -> None:
        self.step = step
        self.relative_step = relative_step
        self.epoch = epoch
        self.iteration = iteration
        self.tags = tags
        # Sinks may memoise what they derive from this snapshot here (it never changes once made).
        self.sink_cache: object = None


EMPTY = StepState(None, None, None, None, ())

_current: contextvars.ContextVar[StepState | None] = contextvars.ContextVar("otel_train_step", default=None)
_latest: StepState = EMPTY
_first_step: int | None = None

class CallSite(threading.local):
    """The frame of the API call in progress on this thread, so sinks need not walk the stack to find it."""

    frame: FrameType | None = None


call_site = CallSite()

# Called with the new step whenever set_step changes it (telemetry samplers and the like).
step_listeners: list[Callable[[int], None]] = []
# Called with the exception whenever one ends a traced span (memory_snapshot=on_oom: docs/profiling.md).
error_listeners: list[Callable[[BaseException], None]] = []


def current() -> StepState:
    """The training context of the calling task or thread."""
    state = _current.get()
    return _latest if state is None else state


def current_step() -> int | None:
    """The current step, or None before the first ``set_step``."""
    return current().step


def set_step(step: int, epoch: int | None = None, iteration: int | None = None) -> bool:
    """Make ``step`` current; returns whether the step changed (tags are cleared when it does)."""
    global _latest, _first_step
    step = _counter("step", step)
    epoch = None if epoch is None else _counter("epoch", epoch)
    iteration = None if iteration is None else _counter("iteration", iteration)
    if _first_step is None:
        _first_step = step
    old = current()
    changed = old.step != step
    tags = () if changed else old.tags
    state = StepState(
        step,
        step - _first_step,
        old.epoch if epoch is None else epoch,
        (None if changed else old.iteration) if iteration is None else iteration,
        tags,
    )
    _latest = state
    _current.set(state)
    return changed


@contextlib.contextmanager
def at_step(step: int) -> Iterator[None]:
    """Records made inside (on this thread or task) carry ``step``, an earlier step than the current one,
    its relative step shifted alike: for a record about a step that has ended (a profiler window's)."""
    old = current()
    if old.step is None:
        yield
        return
    relative = None if old.relative_step is None else old.relative_step - (old.step - step)
    token = _current.set(StepState(step, relative, old.epoch, None, ()))
    try:
        yield
    finally:
        _current.reset(token)


def add_tag(tag: str) -> None:
    """Add ``tag`` to the current step's tags (kept until the step changes)."""
    global _latest
    if not isinstance(tag, str):
        raise TypeError(f"otel_train.add_step_tag: tag must be a str, got {type(tag).__name__}")
    old = current()
    if tag in old.tags:
        return
    state = StepState(old.step, old.relative_step, old.epoch, old.iteration, old.tags + (tag,))
    _latest = state
    _current.set(state)


def reset() -> None:
    """Forget all training context (a new process attempt starts counting relative steps again)."""
    global _latest, _first_step
    _latest = EMPTY
    _first_step = None
    _current.set(None)


MAX_COUNTER = 2**53
"""Steps, epochs and iterations are ints from 0 to 2**53: every JSON reader (doubles) holds them exactly."""


def _counter(label: str, value: object) -> int:
    if not _is_integral(value):
        raise TypeError(f"otel_train.set_step: {label} must be an int from 0 to 2**53, got {type(value).__name__}")
    number = int(value)  # type: ignore[call-overload]
    if not 0 <= number <= MAX_COUNTER:
        raise ValueError(f"otel_train.set_step: {label} must be an int from 0 to 2**53, got {number}")
    return number


def _is_integral(value: object) -> bool:
    # Python and numpy integers only: int() on a tensor would be .item(), a device sync.
    if isinstance(value, int):
        return not isinstance(value, bool)
    return type(value).__module__ == "numpy" and hasattr(value, "__index__")
