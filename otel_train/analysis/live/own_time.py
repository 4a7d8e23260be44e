"""A live process's own time: which of its records ``watch`` trusts as progress, and where its clock
stands now (docs/watch.md, "Clocks").

A record's ``ts`` is its writer's word. One stamped far ahead (a clock that read wrong once, a line
from elsewhere) would otherwise be the newest end time for good: progress "an hour from now" would
hide every hang until then. So a process is judged on its own recent records: where it stands is the median time of
its last :data:`RECENT` records in file order (one odd record cannot move it), and a record more
than :data:`FUTURE_S` past that is *from the future*: reported once per process, and taken neither
as progress, nor as the end of a child span, nor as where the process's clock stands
(:class:`ProcessClock`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any

FUTURE_S = 60.0
"""A record this far past the time of its process's recent records is from the future (late records,
e.g. the comm recorder's, are behind, never ahead)."""
RECENT = 5
"""Records (the newest in file order) whose median time is where a process stands."""
ENDS_KEPT = 64
"""Ok span ends remembered, so a trusted end before a record from the future is still known after it."""


class OwnTime:
    """What a live process's records say of its time: ``progress`` (the newest trusted ok span end),
    ``latest`` (the newest trusted record) and ``limit`` (past it a record is from the future)."""

    __slots__ = ("_recent", "_ends", "progress", "latest", "limit", "said")

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._ends: deque[float] = deque(maxlen=ENDS_KEPT)
        self.progress: float | None = None
        self.latest: float | None = None
        self.limit = float("inf")
        self.said = False  # the first record from the future was reported

    def take(self, records: list[Any], ok_ends: list[float]) -> str | None:
        """A batch in file order and the times of its ok span ends; returns, the first time this process
        has a record from the future, what it was (to be reported once), else None."""
        if not records:
            return None
        self._recent.extend(r.ts for r in records[-RECENT:])
        self.limit = limit = median(self._recent) + FUTURE_S
        self._ends.extend(ok_ends)
        before = [t for t in (self.progress, self.latest) if t is not None and t > limit]  # trusted too early
        earlier = self.progress if self.progress is not None and self.progress <= limit else None
        self.progress = max([t for t in self._ends if t <= limit] + ([earlier] if earlier is not None else []),
                            default=None)
        newest = [r.ts for r in records if r.ts <= limit]
        if self.latest is not None and self.latest <= limit:
            newest.append(self.latest)
        self.latest = max(newest, default=None)
        if self.said:
            return None
        ahead = next((r for r in records if r.ts > limit), None)
        if ahead is None and not before:
            return None
        self.said = True
        stamp = ahead.ts if ahead is not None else max(before)
        what = f"({ahead.kind}) " if ahead is not None else ""
        return f"a record {what}stamped {stamp - limit + FUTURE_S:.0f} s ahead of its other records"

    def trusted(self, ts: float) -> bool:
        """Whether a record of time ``ts`` is not from the future."""
        return ts <= self.limit


class ProcessClock:
    """Now on a process's own clock: where it stood at the latest read (watch's clock less its host's
    ``skew``, but never before its newest record: a writer's clock ahead of watch's is not in watch's
    future) plus watch's monotonic time since, so a step of either wall clock moves no threshold."""

    __slots__ = ("skew", "_elapsed", "_read")

    def __init__(self, elapsed: Callable[[float], float]) -> None:
        self.skew = 0.0  # watch's clock minus its host's clock, when that host's is off (docs/clock.md)
        self._elapsed = elapsed  # watch's monotonic time (a test's clock: that clock)
        self._read: tuple[float, float] | None = None  # (its clock, watch's elapsed time) at the latest read

    def mark_read(self, now: float, latest: float | None, raw: bool = False) -> None:
        """After a read that brought records whose newest trusted time is ``latest``; ``raw``
        (``--no-align``): watch's clock as it is, a writer ahead of it in its future."""
        if latest is not None:
            self._read = (now - self.skew if raw else max(latest, now - self.skew), self._elapsed(now))

    def now(self, now: float) -> float:
        """Watch's clock reading ``now``, on this process's clock."""
        if self._read is None:
            return now - self.skew
        at, then = self._read
        return at + (self._elapsed(now) - then)
