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

from otel_train import schema
from otel_train.analysis import graph
from otel_train.analysis.clock import Clock
from otel_train.analysis.spans import NO_STEP, ProcessState, Run
from otel_train.analysis.stats import columns, peer_medians
from otel_train.analysis.whatif_clock import CLOCK_SAMPLE_OPS, CLOCK_SAMPLE_STEPS, _clock, clock_note

__all__ = ["CLOCK_SAMPLE_OPS", "CLOCK_SAMPLE_STEPS", "_clock", "clock_note", "peers", "typical", "whatif"]
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
    ``early[k, r]``: how many ms before the last rank arrived rank r left collective k (a tail below
    zero; see :meth:`unsynchronized`).
    """

    ranks: list[int]
    phases: list[str]
    sync: list[str]
    keys: np.ndarray
    work: np.ndarray
    measured: np.ndarray
    early: np.ndarray = field(default_factory=lambda: np.empty(0))

    def unsynchronized(self) -> dict[str, Any] | None:
        """None when the sync phases synchronise the ranks (the model applies); else what shows
        they do not: ``{"ranks", "sync", "share", "early_ms"}`` (graph.unsynchronized)."""
        found = graph.unsynchronized(self.early.ravel())
        return None if found is None else {"ranks": list(self.ranks), "sync": list(self.sync), **found}


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
    """Names that run between collectives: children of ``step`` and top-level spans, in step order. Not
    ``comm.*`` ops: one outside the phases (an init-time all_gather whose end its Flight Recorder entry
    found late) may overlap them; its time is ``(untraced)``'s."""
    return [n for n in Run(list(group)).phase_order()
            if n != STEP and not n.startswith(schema.COMM_PREFIX)
            and any(n in d.phases and d.parents.get(n) in (STEP, None) for d in group)]


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
    return SyncTable([d.rank for d in group], phases, names, axis, work, measured, -tails)


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
    """ms of ``name`` spans that ended between collective k-1's end and collective k's start, per k, each
    counted only for its part inside that interval: a span that began earlier (an op outside the steps
    that overlaps them, one whose end came late) never makes a rank's columns add up to more than the
    interval, so every rank's columns split the same time (the two-rank ideal takes columns from both)."""
    _, durs, span_ends = columns(d, name)
    k = np.searchsorted(ends, span_ends, side="left")
    ok = (k >= 1) & (k < ends.size)
    # Not nested in (or overlapping) the collective; the slack covers float rounding of Unix times.
    ok[ok] = span_ends[ok] <= starts[k[ok]] + TIME_SLACK_S
    k, durs, span_ends = k[ok], durs[ok], span_ends[ok]
    inside = (span_ends - np.maximum(span_ends - durs / 1000.0, ends[k - 1])) * 1000.0
    return np.bincount(k, weights=np.clip(inside, 0.0, durs), minlength=ends.size)


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
    steps: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


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
    steps, step_of = np.unique(table.keys[rows] // len(table.sync), return_inverse=True)

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
    out = Scenarios(per_step(table.measured[rows]), per_step(totals.max(axis=1)), per_step(typical.sum(axis=1)),
                    steps=steps)
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


METHODS = ("peers", "typical")


def whatif(run: Run, sync: Sequence[str] = SYNC_PHASES, window: Window | None = None,
           method: str | None = None) -> dict[str, Any]:
    """The ``whatif --json`` object (docs/analysis.md "What-if"; the contract's keys for both methods):
    ``method`` None is ``typical`` for a run with an ``otel_train.mesh``, else ``peers``. ValueError
    for another method."""
    method = method or ("typical" if has_mesh(run) else "peers")
    if method not in METHODS:
        raise ValueError(f"whatif method {method!r}: use one of {', '.join(METHODS)}")
    clock = _clock(run)
    out = (typical if method == "typical" else peers)(run, sync, window, clock)
    out["clock"] = clock_note(run, clock)
    return out


def _empty(sync: Sequence[str]) -> dict[str, Any]:
    return {"method": "peers", "step_ms": {"actual": None, "ideal": None, "measured": None}, "slowdown": None,
            "by_rank": [], "by_phase": [], "by_rank_phase": [], "by_dim": {},
            "shares": {"worker": None, "last_stage": None}, "per_step": {}, "steps": 0, "sync": list(sync), "unsynchronized": []}


def peers(run: Run, sync: Sequence[str] = SYNC_PHASES, window: Window | None = None,
          clock: Clock | None | str = "estimate") -> dict[str, Any]:
    """The ``peers`` answer: step_ms {actual, ideal, measured}, slowdown, by_rank, by_phase,
    by_rank_phase (costliest first), per_step, steps, sync; over every group with at least two ranks
    (the data-parallel closed form of the graph: see the module doc). ``clock``: the hosts' clocks
    (default: the run's estimate)."""
    clock = _clock(run) if isinstance(clock, str) else clock
    tables = [(t, t.unsynchronized()) for t in (sync_table(g, sync, window, clock) for g in run.groups()) if t is not None]
    unsynced = [u for _, u in tables if u is not None]
    parts = [(t, scenarios(t)) for t, u in tables if u is None]
    if not parts:
        return {**_empty(sync), "unsynchronized": unsynced}
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
        "method": "peers",
        "step_ms": {"actual": mean, "ideal": ideal,
                    "measured": float(np.concatenate([s.measured for _, s in parts]).mean())},
        "slowdown": mean / ideal if ideal > 0 else None,
        "by_rank": [{"rank": r, **c} for r, c in combined("by_rank", ranks)],
        "by_phase": [{"phase": p, "collective": p in syncs, **c} for p, c in combined("by_phase", phases)],
        "by_rank_phase": [{"rank": r, "phase": p, **c} for (r, p), c in combined("by_rank_phase", pairs)[:TOP_PAIRS]],
        "by_dim": {}, "shares": {"worker": None, "last_stage": None},
        "per_step": {str(int(k)): float(a / i) if i > 0 else None
                     for _, s in parts for k, a, i in zip(s.steps, s.actual, s.ideal)},
        "steps": int(actual.size),
        "sync": sorted(syncs, key=lambda n: list(sync).index(n) if n in sync else len(sync)),
        "unsynchronized": unsynced,
    }


# ---------------------------------------------------------------------------------------------
# typical: the OSDI '25 method over the dependency graph (otel_train/analysis/graph.py)

WORKER_SHARE = 0.03
"""``shares.worker``: the share of ranks (at least one) with the highest slowdown of their coordinates."""
MAX_PAIRS = 256
"""``typical`` without a mesh replays each (rank, phase) pair only up to this many pairs."""


def has_mesh(run: Run) -> bool:
    """Whether any process declared an ``otel_train.mesh`` (then ``typical`` is the default)."""
    return any(d.mesh for d in run.processes)


def _coords(g: graph.Graph) -> dict[str, np.ndarray]:
    """Per mesh dim, each rank index's coordinate (-1 where its process declared none)."""
    dims = sorted({dim for m in g.mesh.values() for dim in m})
    return {dim: np.array([g.mesh.get(i, {}).get(dim, (0, -1))[1] for i in range(len(g.ranks))]) for dim in dims}


def _scenarios(g: graph.Graph, pairs: bool) -> dict[Any, np.ndarray]:
    """Scenario -> the owners kept as measured: actual (all), ideal (none), each rank, phase, mesh
    index and (dp, pp) cell alone, and every rank but the last pipeline stage's."""
    P, R = len(g.phases), len(g.ranks)
    rank, phase = np.arange(R * P) // P, np.arange(R * P) % P
    out: dict[Any, np.ndarray] = {("actual",): np.ones(R * P, bool), ("ideal",): np.zeros(R * P, bool)}
    out.update({("rank", g.ranks[i]): rank == i for i in range(R)})
    out.update({("phase", name): phase == c for c, name in enumerate(g.phases)})
    coords = _coords(g)
    for dim, at in coords.items():
        out.update({("dim", dim, int(i)): at[rank] == i for i in np.unique(at[at >= 0])})
    if "pp" in coords and (coords["pp"] >= 0).any():
        out[("last_stage",)] = coords["pp"][rank] != coords["pp"].max()
    if "dp" in coords and "pp" in coords:
        cells = {(int(a), int(b)) for a, b in zip(coords["dp"], coords["pp"]) if a >= 0 and b >= 0}
        out.update({("cell", a, b): (coords["dp"][rank] == a) & (coords["pp"][rank] == b) for a, b in cells})
    if pairs and R * P <= MAX_PAIRS:
        out.update({("pair", g.ranks[i], name): (rank == i) & (phase == c)
                    for i in range(R) for c, name in enumerate(g.phases)})
    return out


def _replay(g: graph.Graph, scenarios: dict[Any, np.ndarray]) -> dict[Any, np.ndarray]:
    """Scenario -> its step times (ms), each distinct mask simulated once."""
    keys = list(scenarios)
    rows, index = [], {}
    where = []
    for k in keys:
        b = scenarios[k].tobytes()
        if b not in index:
            index[b] = len(rows)
            rows.append(scenarios[k])
        where.append(index[b])
    masks = np.ones((len(rows), g.fixed + 1), bool)
    masks[:, :-1] = np.array(rows)
    times = graph.step_times(graph.simulate_split(g, masks))
    return {k: times[w] for k, w in zip(keys, where)}


@dataclass(slots=True)
class Replayed:
    """Every graph's step times per scenario, concatenated; the steps and the measured times."""

    times: dict[Any, np.ndarray]
    steps: np.ndarray
    measured: np.ndarray

    def mean(self, key: Any) -> float:
        got = self.times.get(key)
        return float(got.mean()) if got is not None and got.size else float("nan")


def _combine(parts: list[tuple[graph.Graph, dict[Any, np.ndarray]]]) -> Replayed:
    keys = dict.fromkeys(k for _, t in parts for k in t)
    times = {k: np.concatenate([t.get(k, t[("actual",)]) for _, t in parts]) for k in keys}
    return Replayed(times, np.concatenate([g.steps[1:] for g, _ in parts]),
                    np.concatenate([np.diff(g.measured) for g, _ in parts]))


def _workers(gs: list[graph.Graph], rep: Replayed, ideal: float) -> set[int]:
    """The ``WORKER_SHARE`` of ranks with the highest min(by_dim.dp, by_dim.pp) of their coordinates
    (their by_rank slowdown without those dims). Ranks that share both coordinates (tensor-parallel
    siblings) tie: the tie goes to the higher ``by_rank``, then to the lower rank."""
    score: dict[int, float] = {}
    own: dict[int, float] = {}
    for g in gs:
        coords = {d: c for d, c in _coords(g).items() if d in ("dp", "pp")}
        for i, r in enumerate(g.ranks):
            dims = [rep.mean(("dim", d, int(c[i]))) for d, c in coords.items() if c[i] >= 0]
            score[r] = max(score.get(r, -np.inf), min(dims) if dims else rep.mean(("rank", r)))
            mine = rep.mean(("rank", r))
            own[r] = max(own.get(r, -np.inf), mine if np.isfinite(mine) else -np.inf)
    n = max(1, int(np.ceil(WORKER_SHARE * len(score))))
    return set(sorted(score, key=lambda r: (-score[r], -own[r], r))[:n])


def _share(actual: float, ideal: float, without: float) -> float | None:
    """(actual - step with it made ideal) / (actual - ideal); None without a slowdown to share."""
    gap = actual - ideal
    return None if not np.isfinite(without) or gap <= 1e-9 * max(actual, 1.0) else (actual - without) / gap


def _rows(rep: Replayed, kind: str, label: str, ideal: float) -> list[dict[str, Any]]:
    rows = []
    for key in rep.times:
        if key[0] == kind:
            m = rep.mean(key)
            rows.append({label: key[1], "slowdown": m / ideal if ideal > 0 else None, "cost_ms": m - ideal})
    return sorted(rows, key=lambda r: -r["cost_ms"])


def typical(run: Run, sync: Sequence[str] = SYNC_PHASES, window: Window | None = None,
            clock: Clock | None | str = "estimate") -> dict[str, Any]:
    """The ``typical`` answer (docs/analysis.md "What-if"): every op at its typical duration is the
    ideal; ``by_*`` = step time with only that as measured / ideal; shares; per_step."""
    clock = _clock(run) if isinstance(clock, str) else clock
    built = [(g, g.unsynchronized()) for g in (graph.build(grp, clock, window, sync) for grp in run.groups())
             if g is not None and g.steps.size >= 2]
    unsynced = [u for _, u in built if u is not None]
    gs = [g for g, u in built if u is None]
    if not gs:
        return {**_empty(sync), "method": "typical", "unsynchronized": unsynced}
    pairs = not has_mesh(run)
    rep = _combine([(g, _replay(g, _scenarios(g, pairs))) for g in gs])
    actual, ideal = rep.mean(("actual",)), rep.mean(("ideal",))
    chosen = _workers(gs, rep, ideal)
    without = float(np.concatenate([_replay(g, {("w",): ~np.isin(np.arange(len(g.ranks) * len(g.phases)) // len(g.phases),
                                                                   [i for i, r in enumerate(g.ranks) if r in chosen])})[("w",)]
                                    for g in gs]).mean())
    dims = sorted({k[1] for k in rep.times if k[0] == "dim"})
    out = {
        "method": "typical",
        "step_ms": {"actual": actual, "ideal": ideal, "measured": float(rep.measured.mean())},
        "slowdown": actual / ideal if ideal > 0 else None,
        "by_rank": _rows(rep, "rank", "rank", ideal),
        "by_phase": [{**r, "collective": any(r["phase"] in g.collective for g in gs)}
                     for r in _rows(rep, "phase", "phase", ideal)],
        "by_dim": {d: sorted(({"index": k[2], "slowdown": rep.mean(k) / ideal, "cost_ms": rep.mean(k) - ideal}
                              for k in rep.times if k[0] == "dim" and k[1] == d), key=lambda r: r["index"])
                   for d in dims},
        "shares": {"worker": _share(actual, ideal, without),
                   "last_stage": _share(actual, ideal, rep.mean(("last_stage",))) if ("last_stage",) in rep.times else None},
        "workers": sorted(chosen),
        "per_step": {str(int(s)): float(a / i) if i > 0 else None
                     for s, a, i in zip(rep.steps, rep.times[("actual",)], rep.times[("ideal",)])},
        "by_cell": [{"dp": k[1], "pp": k[2], "slowdown": rep.mean(k) / ideal} for k in rep.times if k[0] == "cell"],
        "by_rank_phase": [{"rank": k[1], "phase": k[2], "slowdown": rep.mean(k) / ideal, "cost_ms": rep.mean(k) - ideal}
                          for k in sorted((k for k in rep.times if k[0] == "pair"), key=lambda k: -rep.mean(k))],
        "steps": int(rep.steps.size),
        "sync": list(sync),
        "unsynchronized": unsynced,
        "waits": sum(g.waits for g in gs),
        "snapped": sum(g.snapped for g in gs),
    }
    left: dict[str, int] = {}
    for why, n in (kv for g in gs for kv in g.left_out.items()):
        left[why] = left.get(why, 0) + n
    if left:
        out["left_out"] = {"ops": sum(left.values()), "why": "; ".join(f"{n} with {why}" for why, n in left.items())}
    return out
