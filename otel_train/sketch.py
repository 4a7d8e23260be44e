"""Log-spaced duration buckets: the quantile sketch the watchdog keeps and the per-process digests carry.

The DDSketch idea (Masson et al., VLDB 2019): a duration ``d`` (ns) is counted in bucket
``floor(log(d + 1) / log(GAMMA))``; any quantile read back from the counts is within
``RELATIVE_ACCURACY`` of the true value's, and two sketches merge by adding counts bucket by bucket.
Pure arithmetic, no state: the tracing side (``otel_train.watchdog``) and the reading side
(``summarize --fast``) both import it. Why our own few lines and not PyPI ``ddsketch``/``datasketches``:
docs/analysis.md ("Digests").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

GAMMA = 1.02
RELATIVE_ACCURACY = (GAMMA - 1) / (GAMMA + 1)
"""The largest relative error of a quantile read at a bucket's midpoint (just under 1 %)."""
INV_LOG_GAMMA = 1.0 / math.log(GAMMA)
BUCKETS = int(math.log(2**63) * INV_LOG_GAMMA) + 2
"""Enough buckets for every duration an int64 of nanoseconds can hold."""


def bucket(dur_ns: int) -> int:
    """The bucket that counts a duration of ``dur_ns`` nanoseconds."""
    return int(math.log(dur_ns + 1) * INV_LOG_GAMMA)


def upper_ns(index: int) -> float:
    """The largest duration (ns) bucket ``index`` counts."""
    return GAMMA ** (index + 1)


def mid_ns(index: int) -> float:
    """The value (ns) within ``RELATIVE_ACCURACY`` of every duration bucket ``index`` counts."""
    return 2.0 * GAMMA ** (index + 1) / (GAMMA + 1)


def quantile_index(counts: Iterable[tuple[int, int]], q: float) -> tuple[int, int | None]:
    """(total count, index of the bucket that holds the ``q`` quantile) of ``(index, count)`` pairs in
    ascending index order; None without counts."""
    pairs = [(i, c) for i, c in counts if c]
    total = sum(c for _, c in pairs)
    if not total:
        return 0, None
    rank, seen = q * total, 0
    for index, count in pairs:
        seen += count
        if seen >= rank:
            return total, index
    return total, pairs[-1][0]


def merge(sketches: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """Counts of several sparse sketches (``{bucket: count}``) added together."""
    out: dict[int, int] = {}
    for counts in sketches:
        for index, count in counts.items():
            out[index] = out.get(index, 0) + count
    return out
