"""What every export format shares (being moved here): counts, tracks, counters."""

from __future__ import annotations

from typing import NamedTuple


class Counts(NamedTuple):
    """What a format writer wrote: slices (spans), instants, counter samples, processes."""

    slices: int
    instants: int
    counters: int
    processes: int
