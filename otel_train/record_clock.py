"""The runtime's one time source: wall-clock time that a wall-clock step does not move (docs/clock.md).

Every timestamp the runtime writes (span start and end, instants, scalars) comes from :func:`now_ns`::

    now_ns() = ANCHOR_WALL_NS + (monotonic_ns() - ANCHOR_MONO_NS)

anchored once, when this module is imported (before the first record). Durations and the order of
one process's records therefore come from the monotonic clock: an NTP step, a VM migration or
``date -s`` mid-run changes neither. The records stay on the wall clock of the moment the process
anchored; the watchdog compares :func:`wall_offset_ns` with the previous look's and writes a
``clock_step`` instant when the wall clock has moved by more than :data:`STEP_NS`, so readers
know the host's wall clock and the records' clock now disagree (docs/schema.md).

A forked child keeps its parent's anchor (the monotonic clock is the machine's); ``re_anchor`` is for
tests only.
"""

from __future__ import annotations

from time import monotonic_ns, time_ns

STEP_NS = 100_000_000
"""A wall clock that moved this much against :func:`now_ns` between two looks of the watchdog (at most a
second or so apart) has stepped: a slewing NTP moves it 0.5 ms a second at most."""



def _bracketed() -> tuple[int, int]:
    """(wall, monotonic) read together: the wall clock between two monotonic reads, the tightest of three
    brackets. Two plain reads in a row on a loaded machine can be a scheduling quantum apart, which would
    put every record that far behind the wall clock (and behind a C++ library's wall-clock times)."""
    best = None
    for _ in range(3):
        before = monotonic_ns()
        wall = time_ns()
        after = monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall, (before + after) // 2)
        if after - before < 100_000:
            break
    return best[1], best[2]  # type: ignore[index]


ANCHOR_WALL_NS, ANCHOR_MONO_NS = _bracketed()
_OFFSET_NS = ANCHOR_WALL_NS - ANCHOR_MONO_NS


def now_ns(_mono: object = monotonic_ns) -> int:
    """Nanoseconds since the epoch on the runtime's clock: the anchor's wall time plus monotonic time since."""
    return _mono() + _OFFSET_NS  # type: ignore[operator]


def wall_offset_ns() -> int:
    """How far the wall clock is from :func:`now_ns` now (0 until it steps; a step of -60 s gives about -6e10).

    The wall clock is read between two monotonic reads, up to three times, and the tightest bracket is
    kept: a thread descheduled between two clock reads (a loaded machine) would otherwise look like a
    step of the time it waited.
    """
    wall, mono = _bracketed()
    return wall - (mono + _OFFSET_NS)


def from_wall(wall_ns: int) -> int:
    """A wall-clock time taken just now (an SDK span's own start or end) on the runtime's clock."""
    return wall_ns - wall_offset_ns()


def from_foreign(wall_ns: int) -> int:
    """A wall-clock time taken a little while ago by code whose view of the wall clock may not be this
    process's (a C++ library's: libfaketime steps Python's clock and not torch's), on the runtime's clock.

    It is ``wall_ns`` itself or :func:`from_wall` of it, whichever is later without being in the future:
    the time was taken in the past, and once a step is seen the two differ by the step.
    """
    now = now_ns()
    candidates = [t for t in (wall_ns, from_wall(wall_ns)) if t <= now]
    return max(candidates) if candidates else min(wall_ns, now)


def anchor() -> dict[str, int]:
    """The anchor, as ``process_start`` and ``clock_step`` state it: ``wall_ns`` and ``mono_ns``."""
    return {"wall_ns": ANCHOR_WALL_NS, "mono_ns": ANCHOR_MONO_NS}


def re_anchor() -> None:
    """Anchor again on the current wall clock (tests)."""
    global ANCHOR_WALL_NS, ANCHOR_MONO_NS, _OFFSET_NS
    ANCHOR_WALL_NS, ANCHOR_MONO_NS = _bracketed()
    _OFFSET_NS = ANCHOR_WALL_NS - ANCHOR_MONO_NS
