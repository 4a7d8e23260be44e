"""The step-boundary hook that opens and closes torch.profiler windows (docs/profiling.md).

:meth:`Windows.on_step` is a ``step_listeners`` entry: it runs on the training thread at every step
change, before the new step's ``step`` span opens. Outside a window and with nothing due, its whole
cost is one comparison (``step < self.next_check``). A window opens at the first step of its range
(profiler started, marker recorded) and closes at the first step change past its last step (profiler
stopped, trace written, ``profile`` instant); at shutdown an open window closes at the current step.

The watchdog's thread asks for a window with :meth:`request` (``profile_on``): it sets ``pending`` then
``next_check = 0``, so the next step change on the training thread takes the slow path and opens it.
Never two windows at once, at most ``max_windows`` per process.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from otel_train import record_clock, _report
from otel_train import context as step_context
import otel_train.profiling.output as output
from otel_train.profiling.schedule import MAX_STEP, Schedule

NEVER = MAX_STEP + 1


class _Open:
    __slots__ = ("profiler", "first", "last", "reason", "marker_ns", "activities")

    def __init__(self, profiler: Any, first: int, last: int, reason: str, marker_ns: tuple[int, int],
                 activities: list[str]) -> None:
        self.profiler, self.first, self.last, self.reason = profiler, first, last, reason
        self.marker_ns, self.activities = marker_ns, activities


def _start_profiler(activities: tuple[str, ...]) -> tuple[Any, tuple[int, int], list[str]]:
    """A started torch.profiler, the marker's bracket on the records' clock, the activities used."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    kinds = [ProfilerActivity.CPU] if "cpu" in activities else []
    used = ["cpu"] if kinds else []
    if "cuda" in activities and torch.cuda.is_available():
        kinds.append(ProfilerActivity.CUDA)
        used.append("cuda")
    if not kinds:  # cuda alone asked for, and no GPU: the CPU side is still worth having
        kinds, used = [ProfilerActivity.CPU], ["cpu"]
    prof = profile(activities=kinds, record_shapes="shapes" in activities, with_stack="stack" in activities,
                   profile_memory="memory" in activities)
    prof.start()
    before = record_clock.now_ns()
    with record_function(output.MARKER):
        pass
    return prof, (before, record_clock.now_ns()), used


class Windows:
    """One process's windows: scheduled ones (``schedule`` on a ``profile_ranks`` rank) and requested ones."""

    def __init__(self, *, rank: int, attempt: int | None, run_dir: str, schedule: Schedule | None,
                 window_steps: int, max_windows: int, activities: tuple[str, ...],
                 instant: Callable[[str, dict[str, Any]], None],
                 start_profiler: Callable[[tuple[str, ...]], tuple[Any, tuple[int, int], list[str]]] = _start_profiler
                 ) -> None:
        self.rank, self.attempt, self.run_dir = rank, attempt, run_dir
        self.schedule, self.window_steps, self.max_windows = schedule, window_steps, max_windows
        self.activities, self._instant, self._start_profiler = activities, instant, start_profiler
        self.opened = 0
        self.active: _Open | None = None
        self.pending: str | None = None  # a reason the watchdog's thread asked for
        self.quiet_after_ns = 0  # steps that started before this are not judged by the triggers
        self._done_until = -1  # the last step of the last scheduled window
        self._lock = threading.Lock()  # the boundary and shutdown's close
        self.next_check = NEVER
        self._plan(-1)

    # The hot path: one comparison per step change.
    def on_step(self, step: int) -> None:
        if step < self.next_check:
            return
        self._boundary(step)

    def busy(self) -> bool:
        """Whether a window is open or asked for (the triggers judge no step meanwhile)."""
        return self.active is not None or self.pending is not None

    def request(self, reason: str) -> bool:
        """Ask (from any thread) for a window of ``window_steps`` from the next step change; False when one
        is open or asked for already, or the process has had ``max_windows``."""
        if self.busy() or self.opened >= self.max_windows:
            return False
        self.quiet_after_ns = record_clock.now_ns()
        self.pending = reason
        self.next_check = 0
        return True

    def _plan(self, step: int) -> None:
        if self.active is not None:
            nxt = self.active.last + 1
        elif self.schedule is not None and self.opened < self.max_windows:
            nxt = self.schedule.next_start(max(step + 1, self._done_until + 1))
        else:
            nxt = NEVER
        self.next_check = nxt
        if self.pending is not None:  # asked for while this ran: the next step change opens it
            self.next_check = 0

    def _boundary(self, step: int) -> None:
        with self._lock:
            try:
                active = self.active
                if active is not None and not active.first <= step <= active.last:
                    self._close(min(active.last, max(active.first, step - 1)))
                if self.active is None:
                    self._maybe_open(step)
            except Exception as exc:  # noqa: BLE001 - profiling failing must not stop training
                self.active = None
                self.pending = None
                _report.report_exception("profiler window", exc)
            finally:
                self._plan(step)

    def _maybe_open(self, step: int) -> None:
        reason, last = None, step
        if self.pending is not None:
            reason, self.pending = self.pending, None
            last = step + self.window_steps - 1
        elif self.schedule is not None and step > self._done_until:
            window = self.schedule.window_at(step)
            if window is not None:
                reason, last = "scheduled", window[1]
                self._done_until = last
        if reason is None or self.opened >= self.max_windows:
            return
        profiler, marker, used = self._start_profiler(self.activities)
        self.opened += 1
        self.active = _Open(profiler, step, last, reason, marker, used)

    def _close(self, last: int) -> None:
        active, self.active = self.active, None
        if active is None:
            return
        try:
            active.profiler.stop()
            name = output.window_name(active.reason, active.first, last, self.attempt)
            rel = output.relative_path(self.rank, name)
            output.write_trace(active.profiler, self.run_dir, rel)
        finally:
            self.quiet_after_ns = record_clock.now_ns()
        with step_context.at_step(last):  # the record is about the window's steps (and --steps A-B finds it)
            self._instant(output.INSTANT_PROFILE, output.instant_attrs(
                active.first, last, active.reason, rel, active.marker_ns, self.opened, active.activities))

    def close(self) -> None:
        """At shutdown: close an open window at the current step (its trace and instant are written)."""
        with self._lock:
            active = self.active
            if active is None:
                return
            step = step_context.current_step()
            last = active.first if step is None else min(active.last, max(active.first, step))
            try:
                self._close(last)
            except Exception as exc:  # noqa: BLE001
                _report.report_exception("profiler window at shutdown", exc)
            self.next_check = NEVER
