"""One process ``watch`` follows: its span-model state and what only a live reader knows of it (its
settings, its own clock, whether it is stalled, silent, dead or ended; docs/watch.md)."""

from __future__ import annotations

import time
from collections.abc import Callable

from otel_train import schema
from otel_train.analysis.live.host import HostProbe
from otel_train.analysis.live.own_time import OwnTime, ProcessClock
from otel_train.analysis.live.settings import DEFAULT_WATCHDOG_SETTINGS, StallLimits, WatchdogSettings, restarts_left
from otel_train.analysis.records import FORMAT_OURS, AnyRecord, Instant, SpanEnd, Warn
from otel_train.analysis.spans import STATUS_OPEN, OpenSpan, ProcessState

STALL_RECORD_GRACE_S = 2.0
"""How long past a span's threshold to wait for its watchdog's ``stall`` record (it looks every second)."""

_OK_END = (schema.STATUS_OK, None)


class WatchedProcess:
    """One process instance being followed: its span-model state and what only a live reader knows."""

    __slots__ = ("state", "settings", "restarts_left", "progress_ts", "local", "dead", "silent", "gone_at",
                 "_limits", "_clock", "_child_ends", "own", "clock")

    def __init__(self, state: ProcessState, local: bool,
                 elapsed: Callable[[float], float] = lambda now: time.monotonic()) -> None:
        self.state = state
        self.settings = DEFAULT_WATCHDOG_SETTINGS
        self.restarts_left = 0  # attempts the launcher may still start after this one
        self.progress_ts: float | None = None  # the last span that closed ok (writer's clock; OwnTime)
        self.own = OwnTime()  # which of its records are trusted as its time (own_time.py)
        self.local = local
        self.dead = self.silent = False
        self.gone_at: float | None = None  # when it ended or died (watch's clock)
        self._limits = StallLimits()  # by span name
        self._clock = ProcessClock(elapsed)
        # Now on this process's own clock (docs/watch.md, "Clocks"): clock(watch's now) -> its time.
        self.clock: Callable[[float], float] = self._clock.now
        self._child_ends: dict[str, float] = {}  # open span id -> the latest end of a span it parents

    @property
    def skew(self) -> float:
        """Watch's clock minus its host's clock, when that host's is off (docs/clock.md)."""
        return self._clock.skew

    @skew.setter
    def skew(self, value: float) -> None:
        self._clock.skew = value

    def mark_read(self, now: float, raw: bool = False) -> None:
        """After a read that brought records: where its clock stood then (:meth:`clock`); ``raw``
        (``--no-align``): watch's clock as it is, a writer ahead of it in its future."""
        self._clock.mark_read(now, self.own.latest, raw)  # its newest record not from the future

    @property
    def finished(self) -> bool:
        """Ended through shutdown, or dead."""
        return self.dead or self.state.ended_cleanly

    def take(self, records: list[AnyRecord], warn: Warn | None = None) -> bool:
        """Feed a batch; returns whether it changed what findings could say (an error, the end)."""
        state = self.state
        errors, ended = len(state.errors), state.ended_cleanly
        state.feed(records)
        ahead = self.own.take(records, [r.ts for r in records if type(r) is SpanEnd and r.status in _OK_END])
        self.progress_ts = self.own.progress
        if ahead and warn is not None:  # once per process (own_time.py)
            warn(f"warning: rank {state.rank} (attempt {state.attempt}): {ahead}; not taken as progress")
        self._note_child_ends(records)
        for r in records:
            if type(r) is Instant and r.name == schema.INSTANT_PROCESS_START:
                attrs = r.attrs or {}
                self.settings = WatchdogSettings.of(attrs.get("settings"))
                self.restarts_left = restarts_left(attrs.get("env"))
        return len(state.errors) != errors or state.ended_cleanly != ended

    def _note_child_ends(self, records: list[AnyRecord]) -> None:
        ends, opened = self._child_ends, self.state.opened
        for r in records:
            if type(r) is SpanEnd and r.parent_span_id in opened and ends.get(r.parent_span_id, 0.0) < r.ts <= self.own.limit:
                ends[r.parent_span_id] = r.ts  # type: ignore[index]
        if len(ends) > 2 * len(opened) + 64:
            self._child_ends = {k: v for k, v in ends.items() if k in opened}

    def look(self, probe: HostProbe, now: float) -> bool:
        """Whether it is still there (its pid on this host, else its heartbeats); returns whether it
        was found gone now. A process gone with no span open, in a format without an end record
        (torchtitan, pimm), is ended rather than dead."""
        if self.finished:
            if self.gone_at is None:
                self.gone_at = now
            return False
        state, th = self.state, self.settings
        quiet = self.clock(now) - (self.own.latest or self.clock(now))
        if self.local:
            self.dead = not probe.alive(state.pid, state.first_ts)  # type: ignore[arg-type]
            self.silent = not self.dead and quiet >= th.silence_s
        elif th.watchdog and th.heartbeat_s > 0:
            self.dead = quiet >= th.silence_s
        if not self.dead:
            return False
        self.gone_at = now
        self.dead = state.format == FORMAT_OURS or bool(state.opened)
        state.ended_cleanly = state.ended_cleanly or not self.dead
        return True

    def innermost_since(self, inner: OpenSpan) -> float:
        """When ``inner`` became its thread's innermost open span: the later of its start and the end of
        the last span it parents (the watchdog's rule, docs/watch.md)."""
        return max(inner.start_ts, self._child_ends.get(inner.span_id, 0.0))

    def stalled(self, now: float) -> bool:
        """Whether its innermost open span is past that name's stall threshold in this process, and has
        been the innermost for ``stall_min_s`` (:meth:`innermost_since`; the watchdog's rule).

        A process whose watchdog still writes has the say (its ``stall`` record carries the stacks);
        the same rule computed here decides for one that is silent or runs without a watchdog, and
        for a watchdog that is late by more than :data:`STALL_RECORD_GRACE_S`.
        """
        inner = self.state.innermost
        if inner is None or inner.status != STATUS_OPEN:
            return False
        since, clock = self.innermost_since(inner), self.clock(now)
        if clock - since < self.settings.stall_min_s:
            return False
        if self._stall_record(inner, since):
            return True
        return clock - inner.start_ts >= self._threshold(inner.name) + (STALL_RECORD_GRACE_S if self._watched() else 0.0)

    def awaiting_stall_record(self, now: float) -> bool:
        """Whether its watchdog should write the ``stall`` record (and stacks) of its innermost span soon."""
        inner = self.state.innermost
        if inner is None or inner.status != STATUS_OPEN or not self._watched():
            return False
        since = self.innermost_since(inner)
        due = max(inner.start_ts + self._threshold(inner.name), since + self.settings.stall_min_s)
        return not self._stall_record(inner, since) and self.clock(now) < due + STALL_RECORD_GRACE_S

    def _stall_record(self, inner: OpenSpan, since: float) -> bool:
        # Its watchdog's stall record since it became innermost: one from before a child ran is over.
        record = self.state.stalls.get(inner.span_id)
        return record is not None and record.ts >= since

    def _watched(self) -> bool:
        # Its watchdog is on and still writes (it is neither silent nor gone).
        return self.settings.watchdog and not self.silent and not self.finished

    def _threshold(self, name: str) -> float:
        series = self.state.phases.get(name)
        return self._limits.get(name, [series.durs] if series is not None else [], self.settings)

    def open_for(self, now: float) -> float | None:
        """Seconds its innermost open span has been open."""
        inner = self.state.innermost
        return None if inner is None or self.finished else max(0.0, self.clock(now) - inner.start_ts)

    def status(self, now: float) -> str:
        """ended, dead, silent, stalled or running."""
        if self.state.ended_cleanly:
            return "ended"
        if self.dead:
            return "dead"
        if self.silent:
            return "silent"
        return "stalled" if self.stalled(now) else "running"
