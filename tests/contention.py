"""Stragglers the machine made: the kernel's word that a rank waited for a CPU (tests on a shared machine).

Real multi-rank jobs in the suite share two cores with each other (and, in one of the three fresh-clone
runs, with a busy loop). When the scheduler keeps one rank off the CPU step after step, that rank really
is late, as a rank on a host with a noisy neighbour is, and the analyses rightly name it. A test that
asks for no straggler beside its injected fault admits such a finding only with the kernel's word:
the examples' ``--cpu-wait`` logs each step's schedstat run delay (time runnable but on no CPU) as the
scalar ``cpu_wait_ms``, and the straggler must have waited, at the median step, at least
:data:`STARVED_SHARE` of how late it was, beyond its peers' median wait.

Nothing else excuses a finding: never the product's own rules run again here (re-running the arrival
rule with its own thresholds excused whatever that rule named, a victim included, so a broken victim
filter passed). A rank slowed with no run delay of its own (a virtual CPU's stolen time, a busy sibling
core) is a straggler the test cannot tell from a wrong finding, and the test fails: that is the suite
saying the machine was too busy to judge, not a finding to absorb.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

STARVED_SHARE = 0.5
"""A straggler under CPU contention is the machine's doing when the kernel kept it waiting for a CPU, at the
median step, longer than its peers by at least this share of how late it arrived (of its excess time in
the phase, when it was named by durations)."""


def cpu_waits(records: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """Each rank's wait for a CPU per step (ms), from the examples' ``cpu_wait_ms`` scalars."""
    waits: dict[int, dict[int, float]] = {}
    for r in records:
        if r.get("kind") == "scalar" and "cpu_wait_ms" in (r.get("values") or {}):
            waits.setdefault(r["rank"], {})[r["step"]] = r["values"]["cpu_wait_ms"]
    return waits


def excess_over_peers(by_rank: dict[int, dict[int, float]], rank: int) -> float:
    """``rank``'s value over its peers' median, at the median step they share (NaN: unknown)."""
    peers = [p for p in by_rank if p != rank]
    if rank not in by_rank or not peers:
        return math.nan
    excess = [v - statistics.median(by_rank[p][step] for p in peers)
              for step, v in by_rank[rank].items() if all(step in by_rank[p] for p in peers)]
    return statistics.median(excess) if excess else math.nan


def starved_by(waits: dict[int, dict[int, float]], rank: int) -> float:
    """How much longer than its peers' median ``rank`` waited for a CPU at the median step (NaN: unknown)."""
    return excess_over_peers(waits, rank)


def late_ms(finding: dict[str, Any]) -> float:
    """How late a straggler arrived at the median collective, or, named by durations alone, how much longer
    than its peers its phase took per step (a fresh-clone run beside a busy loop: rank 0's forward +2.7 ms
    per step in a clean run, while it waited 17.3 ms a step longer than its peer for a CPU)."""
    arrived = finding.get("gap_ms") or (finding.get("arrival") or {}).get("gap_ms")
    return arrived or finding.get("excess_ms") or math.inf


def starved(finding: dict[str, Any], waits: dict[int, dict[int, float]]) -> bool:
    """Whether a straggler finding is explained by its rank's wait for a CPU (False without the waits)."""
    return finding.get("kind") == "straggler" and starved_by(waits, finding["rank"]) >= STARVED_SHARE * late_ms(finding)
