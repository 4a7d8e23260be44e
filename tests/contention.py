"""Stragglers the machine made: the kernel's word that a rank waited for a CPU (tests on a shared machine).

Real multi-rank jobs in the suite share two cores with each other (and, in one of the three fresh-clone
runs, with a busy loop). When the scheduler keeps one rank off the CPU step after step, that rank really
is late, as a rank on a host with a noisy neighbour is, and the analyses rightly name it. A test that
asks for no straggler beside its injected fault admits such a finding only with the kernel's word:
the examples' ``--cpu-wait`` logs each step's schedstat run delay (time runnable but on no CPU) as the
scalar ``cpu_wait_ms``, and the straggler must have waited, at the median step, at least
:data:`STARVED_SHARE` of how late it was, beyond its peers' median wait.

The kernel's word is not the only way a shared machine makes a rank late: a virtual CPU whose time the
hypervisor steals, or a core whose sibling runs the busy loop, runs a rank slower without any run delay
(CI: rank 1 of a clean pair beside a busy loop last at 57 of 63 collectives by 1.3 ms, its run delay
0.03 ms shorter than its peer's). A straggler named by its arrivals is then admitted when the records
themselves show it, computed here from the comm spans' starts and nothing else (:func:`arrivals_show`):
the finding must be true of the run, which is what the tools answer for.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from otel_train import schema
from otel_train.analysis.findings import ARRIVAL_MIN_GAP_MS, ARRIVAL_MIN_SHARE

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
    """Whether a straggler finding is explained by its rank's wait for a CPU."""
    return starved_by(waits, finding["rank"]) >= STARVED_SHARE * late_ms(finding)


def arrivals_show(finding: dict[str, Any], records: list[dict[str, Any]]) -> bool:
    """Whether the raw records show what an arrival finding says: in its group, over the collectives inside
    steps that every member started, its rank started last at :data:`ARRIVAL_MIN_SHARE` of them at least,
    by a median of :data:`ARRIVAL_MIN_GAP_MS` over the next-latest (span starts, one host's clock)."""
    if finding.get("by") != "arrival":
        return False
    group, rank = finding["comm"]["group"], finding["rank"]
    members: set[int] = set()
    starts: dict[int, dict[int, float]] = {}
    for r in records:
        attrs = r.get("attrs") or {}
        if r.get("kind") == schema.INSTANT and r.get("name") == schema.INSTANT_COMM_GROUP and attrs.get("group") == group:
            members = set(attrs.get("ranks") or ())
        elif (r.get("kind") == schema.SPAN_START and str(r.get("name", "")).startswith(schema.COMM_PREFIX)
              and r.get("step") is not None and attrs.get(schema.ATTR_COMM_GROUP) == group
              and schema.ATTR_COMM_PEER not in attrs):
            starts.setdefault(attrs[schema.ATTR_COMM_SEQ], {})[r["rank"]] = r["ts"]
    full = [s for s in starts.values() if members and set(s) == members]
    gaps = []
    for s in full:
        (t2, _), (t, last) = sorted((t, m) for m, t in s.items())[-2:]
        if last == rank:
            gaps.append((t - t2) * 1000.0)
    return bool(full) and len(gaps) >= ARRIVAL_MIN_SHARE * len(full) and statistics.median(gaps) >= ARRIVAL_MIN_GAP_MS


def machine_made(finding: dict[str, Any], waits: dict[int, dict[int, float]], records: list[dict[str, Any]]) -> bool:
    """Whether a straggler named where none was injected is the shared machine's: the kernel's word that
    it waited for a CPU (:func:`starved`), or, named by its arrivals, the records showing them
    (:func:`arrivals_show`)."""
    return starved(finding, waits) or arrivals_show(finding, records)
