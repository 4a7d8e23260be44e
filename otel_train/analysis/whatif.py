"""What-if: how much faster each step would be without each rank's and each phase's slowness.

The synchronisation model (docs/analysis.md "What-if") is data parallel: every step ends its
synchronisation with the gradient all-reduce inside ``backward`` (other names with ``sync=``).
Between two collectives each rank works on its own (the previous step's optimizer, hooks,
checkpoint, then this step's data_fetch, forward, ...); a collective completes when the last rank
arrives, and each rank leaves it after its own remaining time (its *tail*: the work after the last
arrival, including the all-reduce itself). So the time between two collectives is

    max over ranks of (its tail in the previous collective + its work until this collective)

and everything a rank spends in a collective beyond its tail is waiting, charged to whoever made
it wait. Work is measured on each rank's own clock; arrivals and tails need one clock across ranks,
which the collectives themselves provide: the run's clock estimate (docs/clock.md) puts every host
on the reference host's clock. Without one (``--no-align``, a run without a collective across hosts,
a caller that passes none), each host's clock is shifted so that its collective ends line up with its
peers' at the median (raw clocks cannot be replayed: a host seconds ahead would "wait" seconds).

"Made typical" replaces values by what peers did at the same step, then takes that max again: one
rank's by the median of its peers; everyone's at once (one phase, or the ideal) by the median over
all ranks (with two ranks, whose median would keep half of any straggler, by the rank that is
faster in that phase over the run).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np

from otel_train.analysis.clock import Clock
from otel_train.analysis.spans import NO_STEP, ProcessState, Run
from otel_train.analysis.stats import columns, peer_medians
from otel_train.phases import BACKWARD, STEP

SYNC_PHASES = (BACKWARD,)
"""Phases that end with a collective, in step order (data parallel: the gradient all-reduce)."""
UNTRACED = "(untraced)"
"""The column for time between two collectives that no phase span covers."""
TIME_SLACK_S = 50e-6
"""Timestamps (Unix seconds as doubles, durations in rounded ms) agree to about a microsecond."""
TOP_PAIRS = 10
"""How many (rank, phase) pairs ``whatif`` lists, costliest first."""

Window = tuple[int, int]


@dataclass(slots=True)
class SyncTable:
    """One group's collectives (index k) and what each rank did between them.

    ``keys[k]`` is ``step * len(sync) + index in sync`` of collective k. ``work[k, r, c]`` (k >= 1)
    is the ms rank r spent on column c on the way from collective k-1 to collective k: its tail in
    collective k-1 (in that phase's column), each phase that ended in between, and ``(untraced)``
    for the rest; the interval lasts ``max over r of work[k, r].sum()``. ``measured[k]`` is the
    interval as measured (median over ranks of the time between the two ends). Row 0 only anchors.
    """

    ranks: list[int]
    phases: list[str]
    sync: list[str]
    keys: np.ndarray
    work: np.ndarray
    measured: np.ndarray


@dataclass(slots=True)
class _Events:
    """One rank's collectives, keyed ``step * len(sync) + index in sync``, sorted by key."""

    keys: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    durs: np.ndarray


def _events(d: ProcessState, sync: Sequence[str]) -> _Events:
    keys, ends, durs = [], [], []
    for i, name in enumerate(sync):
        steps, dur, end = columns(d, name)
        ok = steps != NO_STEP
        keys.append(steps[ok] * len(sync) + i)
        ends.append(end[ok])
        durs.append(dur[ok])
    k, e, du = np.concatenate(keys), np.concatenate(ends), np.concatenate(durs)
    order = np.lexsort((e, k))
    k, e, du = k[order], e[order], du[order]
    last = np.ones(k.size, dtype=bool)  # several spans of one key (gradient accumulation): the last syncs
    last[:-1] = k[1:] != k[:-1]
    k, e, du = k[last], e[last], du[last]
    return _Events(k, e - du / 1000.0, e, du)


def _local_phases(group: Sequence[ProcessState]) -> list[str]:
    """Names that run between collectives: children of ``step`` and top-level spans, in step order."""
    return [n for n in Run(list(group)).phase_order()
            if n != STEP and any(n in d.phases and d.parents.get(n) in (STEP, None) for d in group)]


def sync_table(group: Sequence[ProcessState], sync: Sequence[str] = SYNC_PHASES,
               window: Window | None = None, clock: Clock | None = None) -> SyncTable | None:
    """The :class:`SyncTable` of one group (ranks that ran together), over steps ``window`` (inclusive)
    when given; None with fewer than two ranks or two shared collectives (no ``sync`` phase: the
    model does not apply). ``clock``: the hosts' clocks arrivals are compared on (default: a per-host
    median shift)."""
    names = [n for n in sync if all(n in d.phases for d in group)]
    if len(group) < 2 or not names:
        return None
    events = [_events(d, names) for d in group]
    axis = reduce(np.intersect1d, [e.keys for e in events])
    if window is not None:
        steps = axis // len(names)
        axis = axis[(steps >= window[0]) & (steps <= window[1])]
    if axis.size < 2:
        return None
    local = _local_phases(group)
    phases = list(dict.fromkeys([*names, *local, UNTRACED]))
    work = np.zeros((axis.size, len(group), len(phases)))
    starts, ends = np.empty((axis.size, len(group))), np.empty((axis.size, len(group)))
    for j, (d, ev) in enumerate(zip(group, events)):
        at = np.searchsorted(ev.keys, axis)
        starts[:, j], ends[:, j] = ev.starts[at], ev.ends[at]
        for name in local:
            work[:, j, phases.index(name)] = _assign(d, name, starts[:, j], ends[:, j])
    work[1:, :, -1] = (starts[1:] - ends[:-1]) * 1000.0 - work[1:].sum(axis=2)
    hosts = [d.host for d in group]
    if clock is not None:
        on_ref = clock.align_many(hosts, starts), clock.align_many(hosts, ends)
    else:
        offset = _host_offsets(ends, hosts)
        on_ref = starts - offset, ends - offset
    last_arrival = on_ref[0].max(axis=1, keepdims=True)
    tails = (on_ref[1] - last_arrival) * 1000.0
    for i, name in enumerate(names):
        prev = np.flatnonzero(axis[:-1] % len(names) == i)
        work[prev + 1, :, phases.index(name)] += tails[prev]
    measured = np.zeros(axis.size)
    measured[1:] = np.median(np.diff(ends, axis=0), axis=1) * 1000.0
    return SyncTable([d.rank for d in group], phases, names, axis, work, measured)


def _host_offsets(ends: np.ndarray, hosts: list[str | None]) -> np.ndarray:
    """Per rank, its host's clock offset: how much later (s) that host's ranks typically leave a
    collective than the median rank. Ranks of one host share its clock, so one host gets none."""
    offset = np.zeros(len(hosts))
    if len(set(hosts)) < 2:
        return offset
    late = ends - np.median(ends, axis=1, keepdims=True)
    for host in set(hosts):
        mine = np.array([h == host for h in hosts])
        offset[mine] = np.median(late[:, mine])
    return offset


def _assign(d: ProcessState, name: str, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """ms of ``name`` spans that ended between collective k-1's end and collective k's start, per k."""
    _, durs, span_ends = columns(d, name)
    k = np.searchsorted(ends, span_ends, side="left")
    ok = (k >= 1) & (k < ends.size)
    # Not nested in (or overlapping) the collective; the slack covers float rounding of Unix times.
    ok[ok] = span_ends[ok] <= starts[k[ok]] + TIME_SLACK_S
    return np.bincount(k[ok], weights=durs[ok], minlength=ends.size)


# ---------------------------------------------------------------------------------------------
# Counterfactual step times


@dataclass(slots=True)
class Scenarios:
    """Step times (ms, one per step) as measured, as modelled, and with things made typical."""

    measured: np.ndarray
    actual: np.ndarray
    ideal: np.ndarray
    by_rank: dict[int, np.ndarray] = field(default_factory=dict)
    by_phase: dict[str, np.ndarray] = field(default_factory=dict)
    by_rank_phase: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)


def _typical(work: np.ndarray) -> np.ndarray:
    """Every rank's value made typical at once, [k, c]: the median over ranks, or with two ranks the
    value of the rank that is faster in that column over the run."""
    if work.shape[1] >= 3:
        return np.median(work, axis=1)
    faster = np.median(work, axis=0).argmin(axis=0)  # per column
    return np.take_along_axis(work, faster[None, None, :], axis=1)[:, 0, :]


def scenarios(table: SyncTable) -> Scenarios:
    """Every what-if of one group, one value per step (the intervals of a step added up).

    Intervals that span a missing collective (a step without one on some rank) are left out.
    """
    rows = np.flatnonzero(np.diff(table.keys) == 1) + 1
    _, step_of = np.unique(table.keys[rows] // len(table.sync), return_inverse=True)

    def per_step(values: np.ndarray) -> np.ndarray:
        return np.bincount(step_of, weights=values)

    work = table.work[rows]
    totals = work.sum(axis=2)
    typical = _typical(work)
    peers = np.stack([peer_medians(work[:, :, c]) for c in range(work.shape[2])], axis=2)
    # The slowest of the *other* ranks, per interval and rank: the top two of each row.
    top = np.sort(totals, axis=1)
    first, second = top[:, -1:], top[:, -2:-1]
    others = np.where(totals >= first, second, first)
    out = Scenarios(per_step(table.measured[rows]), per_step(totals.max(axis=1)), per_step(typical.sum(axis=1)))
    rank_phase = np.maximum(totals[:, :, None] - work + peers, others[:, :, None])
    for j, rank in enumerate(table.ranks):
        out.by_rank[rank] = per_step(np.maximum(peers[:, j].sum(axis=1), others[:, j]))
        for c, name in enumerate(table.phases):
            out.by_rank_phase[(rank, name)] = per_step(rank_phase[:, j, c])
    for c, name in enumerate(table.phases):
        out.by_phase[name] = per_step((totals - work[:, :, c] + typical[:, c:c + 1]).max(axis=1))
    return out


def step_cost(actual: float, typical: float) -> dict[str, float]:
    """What something costs per step, given the mean step time with and without it made typical."""
    cost = actual - typical
    return {"slowdown": actual / typical if typical > 0 else float("nan"), "cost_ms": cost,
            "cost_pct": 100.0 * cost / actual if actual > 0 else 0.0}


# ---------------------------------------------------------------------------------------------
# The whatif answer


def whatif(run: Run, sync: Sequence[str] = SYNC_PHASES, window: Window | None = None) -> dict[str, Any]:
    """The ``whatif --json`` object: step_ms {actual, ideal, measured}, slowdown, by_rank, by_phase,
    by_rank_phase (costliest first), steps, sync; over every group with at least two ranks."""
    clock = _clock(run)
    parts = [s for s in (_group_scenarios(g, sync, window, clock) for g in run.groups()) if s is not None]
    if not parts:
        return {"step_ms": {"actual": None, "ideal": None, "measured": None}, "slowdown": None,
                "by_rank": [], "by_phase": [], "by_rank_phase": [], "steps": 0, "sync": list(sync)}
    actual = np.concatenate([s.actual for _, s in parts])
    mean = float(actual.mean())

    def combined(pick: str, keys: Iterable[Any]) -> list[tuple[Any, dict[str, float]]]:
        rows = []
        for key in keys:
            cf = np.concatenate([getattr(s, pick).get(key, s.actual) for _, s in parts])
            rows.append((key, step_cost(mean, float(cf.mean()))))
        return sorted(rows, key=lambda r: -r[1]["cost_ms"])

    ranks = sorted({r for _, s in parts for r in s.by_rank})
    phases = list(dict.fromkeys(p for _, s in parts for p in s.by_phase))
    pairs = [(r, p) for r in ranks for p in phases]
    ideal = float(np.concatenate([s.ideal for _, s in parts]).mean())
    syncs = {name for t, _ in parts for name in t.sync}
    return {
        "step_ms": {"actual": mean, "ideal": ideal,
                    "measured": float(np.concatenate([s.measured for _, s in parts]).mean())},
        "slowdown": mean / ideal if ideal > 0 else None,
        "by_rank": [{"rank": r, **c} for r, c in combined("by_rank", ranks)],
        "by_phase": [{"phase": p, "collective": p in syncs, **c} for p, c in combined("by_phase", phases)],
        "by_rank_phase": [{"rank": r, "phase": p, **c} for (r, p), c in combined("by_rank_phase", pairs)[:TOP_PAIRS]],
        "steps": int(actual.size),
        "sync": sorted(syncs, key=lambda n: list(sync).index(n) if n in sync else len(sync)),
    }


def _clock(run: Run) -> Clock | None:
    """The run's clock estimate when it aligns hosts; None (the per-host median shift) for one host,
    hosts without a shared collective, and ``--no-align``."""
    if len({d.host for d in run.processes}) < 2:
        return None
    clock = next((g.clock for g in run.comm.values() if g.clock is not None), None)
    return clock if clock is not None and clock.applied else None


def _group_scenarios(group: list[ProcessState], sync: Sequence[str], window: Window | None,
                     clock: Clock | None = None) -> tuple[SyncTable, Scenarios] | None:
    table = sync_table(group, sync, window, clock)
    return None if table is None else (table, scenarios(table))
