"""The stall rule, shared by the writer side (the watchdog thread) and the reader side (``watch``).

A span is a *stall* once it has been open longer than ``max(stall_min_s, stall_factor × p99)``, the
p99 being that span name's past durations in the same process; a name with fewer than
:data:`MIN_HISTORY` past durations has no trustworthy p99 yet and gets ``stall_min_s × stall_factor``.
The settings are ``stall_min_s`` and ``stall_factor`` (docs/settings.md, docs/watch.md).
"""

from __future__ import annotations

MIN_HISTORY = 5
"""Past durations a name needs before its p99 counts."""
MAX_STALLS_PER_SPAN = 6
"""Stall records per span: at its threshold, then at each doubling of its open time."""


def stall_threshold(count: int, p99_s: float | None, stall_min_s: float, stall_factor: float) -> float:
    """Seconds a span may stay open before it is a stall, given ``count`` past durations with ``p99_s``."""
    if count < MIN_HISTORY or p99_s is None:
        return stall_min_s * stall_factor
    return max(stall_min_s, stall_factor * p99_s)
