"""Diff: run B against run A, per phase and per rank x phase, with a significance test.

Durations are compared on the steps both runs have (by step number) when they share any, else on
all steps. Each comparison reports p50/p95 in both runs, the change of the median, and the
two-sided Mann–Whitney U p-value (ranks only, so skewed durations are fine). A change is a finding
only when it is both significant (p < ``max_p``) and big enough to matter (at least ``min_pct`` of
A's median and ``min_ms``).

What is tested is what is independent (docs/analysis.md "Diff"). Consecutive steps are not: load
comes and goes over many steps and moves every rank alike. So:

* a rank is judged on its time *relative to its peers at the same step* (its per-step time over the
  median of the other ranks'): load that every rank of the run shares cancels out, in the test and
  in the size gate alike (its change is the change of that ratio's median, in ms that share of A's
  median: ``peer_delta_pct``, ``peer_delta_ms``);
* a phase (all ranks) is judged on its per-step median over the ranks;
* either series is cut into blocks of consecutive steps at least twice its integrated
  autocorrelation time long (:func:`block_medians`), and the Mann–Whitney test compares the blocks'
  medians: a slow minute of one run counts once, not once per step. Fewer than :data:`MIN_BLOCKS`
  blocks on either side are never significant: a change big enough to matter is then
  ``undecided`` (listed, never reported as no change).

Culprits, not victims: time a rank spends in a collective phase (``backward``) or a ``comm.*`` op
waiting for a late peer is not that phase's work, so collective phases and comm ops are judged on
their own time (a comm op's: from the last member's arrival to its end) (the what-if
model's tail: from the last rank's arrival to leaving; docs/analysis.md "What-if"), a change
that most ranks of a phase share is one finding for all ranks instead of one per rank, and a phase
that contains others (``step``) gets none: its change is theirs.

A change every rank shares has no control inside a run: the run's own conditions (where the kernel
placed the ranks, what else ran) move all ranks alike, and they are drawn once per run. Given more
runs of A's kind (``baselines``: the same job run again), such a change must also lie outside the
spread of A's runs: B's median further from the mean of the A runs' medians than Student's t
prediction bound (at ``max_p``, two-sided) over their standard deviation. A change of one rank is
judged against its peers of the same run, which share the run's conditions, and keeps its verdict.
A collective's own time (its transfer) is such a condition: where the ranks were placed and what
shares their links is drawn once per launch. Without ``baselines`` a collective's change is
therefore ``undecided`` (reason :data:`ONE_RUN`), never a finding: one run of A cannot tell it from a
change of the code.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from otel_train import schema
from otel_train.analysis.spans import NO_STEP, Run
from otel_train.analysis.stats import mann_whitney, quantiles, student_t_isf
from otel_train.analysis.whatif import SYNC_PHASES, sync_table

REGRESSION = "regression"
IMPROVEMENT = "improvement"
UNDECIDED = "undecided"
"""A change big enough to matter that could not be judged (why: :data:`FEW_BLOCKS` or :data:`ONE_RUN`)."""
REASON = "undecided_reason"
"""On a comparison row judged undecided for a reason other than :data:`FEW_BLOCKS`: that reason."""
FEW_BLOCKS = "few_blocks"
"""Undecided: a series with fewer than :data:`MIN_BLOCKS` independent blocks of steps."""
ONE_RUN = "one_run"
"""Undecided: a collective's own time changed, and only one run of A shows what a launch draws."""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a change is a finding: p below ``max_p``, and at least ``min_pct`` % and ``min_ms`` ms."""

    max_p: float = 0.01
    min_pct: float = 5.0
    min_ms: float = 0.5


Samples = dict[tuple[int, str], np.ndarray]
Keyed = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
"""Per (rank, phase): (step of each value, value), in step order."""

BLOCK_MIN = 5
"""Values per block at least."""
MAX_BLOCKS = 24
"""Blocks per series at most (longer series get longer blocks)."""
MIN_BLOCKS = 5
"""Fewer blocks than this on either side: never significant (5 against 5 reach p = 0.008 at best)."""
MIN_RUNS = 3
"""A runs (A and its ``baselines``) needed to measure their spread: two give one degree of freedom."""


def autocorrelation_time(x: np.ndarray) -> float:
    """Integrated autocorrelation time 1 + 2 Σ ρ_k of a series, summed while the pairs ρ_k + ρ_k+1 stay
    positive (Geyer's initial positive sequence): 1 for independent values, (1 + ρ) / (1 − ρ) for AR(1)."""
    n = x.size
    if n < 4 or not np.ptp(x) > 0:
        return 1.0
    d = x - x.mean()
    acf = np.correlate(d, d, "full")[n - 1:] / (d @ d)
    tau = 1.0
    for k in range(1, n // 2 - 1, 2):
        pair = acf[k] + acf[k + 1]
        if pair <= 0:
            break
        tau += 2.0 * pair
    return tau


def block_medians(x: np.ndarray) -> np.ndarray:
    """Medians of consecutive blocks of ``x``: blocks at least :data:`BLOCK_MIN` values and twice the
    series' autocorrelation time long, at most :data:`MAX_BLOCKS` of them; the remainder joins the last."""
    if x.size == 0:
        return x
    size = max(BLOCK_MIN, math.ceil(2.0 * autocorrelation_time(x)), math.ceil(x.size / MAX_BLOCKS))
    whole = (max(1, x.size // size) - 1) * size  # the blocks before the last, all ``size`` long
    return np.append(np.median(x[:whole].reshape(-1, size), axis=1), np.median(x[whole:]))


def _block_p(a: np.ndarray, b: np.ndarray) -> tuple[float, list[int]]:
    """Two-sided Mann–Whitney p of the block medians of two series (1.0 with too few blocks), and how
    many blocks each side had."""
    ba, bb = block_medians(a), block_medians(b)
    p = mann_whitney(ba, bb)[1] if min(ba.size, bb.size) >= MIN_BLOCKS else 1.0
    return p, [int(ba.size), int(bb.size)]


def _per_step(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values summed per step (a step-less value counts as a step of its own), in step order."""
    keys = np.where(steps == NO_STEP, -2 - np.arange(steps.size), steps)
    uniq, inverse = np.unique(keys, return_inverse=True)
    sums = np.zeros(uniq.size)
    np.add.at(sums, inverse, values)
    return uniq, sums


def _step_matrix(keyed: Keyed, phase: str) -> tuple[list[int], np.ndarray]:
    """(ranks, matrix steps × ranks) of one phase's per-step times, NaN where a rank has none."""
    cols = {r: _per_step(*v) for (r, n), v in keyed.items() if n == phase}
    ranks = sorted(cols)
    if not ranks:
        return [], np.empty((0, 0))
    axis = np.unique(np.concatenate([cols[r][0] for r in ranks]))
    m = np.full((axis.size, len(ranks)), np.nan)
    for j, r in enumerate(ranks):
        m[np.searchsorted(axis, cols[r][0]), j] = cols[r][1]
    return ranks, m


def _tested(keyed: Keyed, phase: str, exclude: frozenset[int] = frozenset()) -> dict[int | None, np.ndarray]:
    """The series a phase is tested on: ``None`` → its per-step median over the ranks; each rank → its
    per-step time over the median of its peers' at the same step (its own time when it has no peers).
    Ranks in ``exclude`` are no rank's peers (while another rank is left)."""
    ranks, m = _step_matrix(keyed, phase)
    if not ranks:
        return {}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: a step no peer ran
        out: dict[int | None, np.ndarray] = {None: _finite(np.nanmedian(m, axis=1))}
        for j, r in enumerate(ranks):
            cols = [k for k, q in enumerate(ranks) if k != j and q not in exclude] or \
                [k for k in range(len(ranks)) if k != j]
            peers = np.nanmedian(m[:, cols], axis=1) if cols else np.ones(m.shape[0])
            out[r] = _finite(m[:, j] / peers)
    return out


def _without_the_changed(rows: list[dict[str, Any]], judged: tuple[Keyed, Keyed], th: Thresholds) -> None:
    """Culprits, not victims, among peers: a rank whose change moved its peers' median (one rank of four
    50 % slower raises the median of the other three's) makes its peers look changed the other way. So
    the ranks of a phase that came out changed are judged again against the peers that did not."""
    for name in dict.fromkeys(r["phase"] for r in rows):
        mine = [r for r in rows if r["phase"] == name]
        changed = frozenset(r["rank"] for r in mine if r[REGRESSION] or r[IMPROVEMENT] or r[UNDECIDED])
        if not changed or len(changed) >= len(mine):
            continue
        tested = [_tested(k, name, changed) for k in judged]
        for r in (r for r in mine if r["rank"] in changed):
            a, b = (k.get((r["rank"], name), (_NONE, _NONE))[1] for k in judged)
            r.update(_verdict(a, b, *(t.get(r["rank"], _NONE) for t in tested), th, peers=len(mine) - len(changed)))


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


def _steps_of(run: Run) -> np.ndarray:
    cols = [np.frombuffer(s.steps, np.int64) for d in run.processes for s in d.phases.values() if s.steps]
    steps = np.unique(np.concatenate(cols)) if cols else np.empty(0, np.int64)
    return steps[steps != NO_STEP]


def _durations(run: Run, steps: np.ndarray | None) -> Keyed:
    """Per (rank, phase): its span durations with their steps (all attempts), of ``steps`` when given."""
    out: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for d in run.processes:
        for name, s in d.phases.items():
            durs, at = np.frombuffer(s.durs, np.float64), np.frombuffer(s.steps, np.int64)
            if steps is not None:
                keep = (at == NO_STEP) | np.isin(at, steps)
                durs, at = durs[keep], at[keep]
            out.setdefault((d.rank, name), []).append((at, durs))
    return {k: _joined(v) for k, v in out.items()}


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _own_times(run: Run, steps: np.ndarray | None, sync: Sequence[str]) -> Keyed:
    """Per (rank, collective phase): its own time in the collective, waiting excluded (what-if tails)."""
    out: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for group in run.groups():
        table = sync_table(group, sync)
        if table is None or table.unsynchronized() is not None:
            continue
        prev = table.keys[:-1]
        for i, name in enumerate(table.sync):
            rows = prev % len(table.sync) == i
            if steps is not None:
                rows &= np.isin(prev // len(table.sync), steps)
            col = table.work[1:, :, table.phases.index(name)][rows]
            at = (prev // len(table.sync))[rows]
            for j, rank in enumerate(table.ranks):
                out.setdefault((rank, name), []).append((at, col[:, j]))
    return {k: _joined(v) for k, v in out.items()}


def _comm_own_times(run: Run, steps: np.ndarray | None) -> Keyed:
    """Per (rank, ``comm.*`` name): each op's own time, from the last member's arrival to its end (a
    recv's and its send's: from the later of the two), the waiting for late members excluded."""
    out: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for graph in run.comm.values():
        matched = [list(ops.values()) for ops in graph.collectives.values()]
        matched += [[o for o in pair if o is not None] for pair in graph.p2p.values()]
        for ops in matched:
            if len(ops) < 2 or any(o.start is None or o.end is None for o in ops):
                continue
            last = max(o.start for o in ops)  # type: ignore[type-var]
            for o in ops:
                step = NO_STEP if o.step is None else o.step
                if steps is None or step == NO_STEP or np.isin(step, steps):
                    out.setdefault((o.rank, schema.comm_span_name(o.op)), []).append(
                        (step, max(0.0, (o.end - last) * 1000.0)))  # type: ignore[operator]
    return {k: (np.array([s for s, _ in v], np.int64), np.array([d for _, d in v])) for k, v in out.items()}


def _samples(run: Run, steps: np.ndarray | None, sync: Sequence[str]) -> tuple[Samples, Keyed]:
    """(raw durations, judged values with their steps): collective phases and comm ops are judged on
    their own time."""
    raw = _durations(run, steps)
    own = {**_own_times(run, steps, sync), **_comm_own_times(run, steps)}
    return {k: v[1] for k, v in raw.items()}, {**raw, **own}


_NONE = np.empty(0)


def _pooled(samples: Samples | Keyed, phase: str) -> np.ndarray:
    cols = [v[1] if isinstance(v, tuple) else v for (_, name), v in samples.items() if name == phase]
    return np.concatenate(cols) if cols else np.empty(0)


def _p50(values: np.ndarray) -> float | None:
    return quantiles(values, (0.5,))[0] if values.size else None


def _verdict(a: np.ndarray, b: np.ndarray, ta: np.ndarray, tb: np.ndarray, th: Thresholds,
             peers: int = 0) -> dict[str, Any]:
    """The judged values ``a``, ``b`` and their tested series ``ta``, ``tb`` (see the module doc):
    p_value, the medians (judged_ms) and their change (delta_ms), and whether that is a
    ``regression`` or an ``improvement``. ``peers`` > 0 (a rank's row: ``ta``, ``tb`` are its times over
    its peers'): the size gate and the direction are the tested series' change, ``peer_delta_pct``,
    and that share of A's median, ``peer_delta_ms``; a run's own load moves the raw medians. With one
    peer the two ranks' ratios mirror each other (which one changed, the ratio cannot tell): the raw
    change must then matter too, as for a phase."""
    if not a.size or not b.size:
        return {"p_value": math.nan, "delta_ms": math.nan, "judged_ms": [_p50(a), _p50(b)], "blocks": [0, 0],
                REGRESSION: False, IMPROVEMENT: False, UNDECIDED: False}
    p, blocks = _block_p(ta, tb)
    row = {"p_value": p, "delta_ms": float(np.median(b) - np.median(a)),
           "judged_ms": [float(np.median(a)), float(np.median(b))], "blocks": blocks}
    tested = _pct(float(np.median(ta)), float(np.median(tb))) if ta.size and tb.size else None
    # The tested series' own change must matter too, the same way.
    agrees = tested is not None and abs(tested) >= th.min_pct and (tested > 0) == (row["delta_ms"] > 0)
    matters, up = _big(row, th) and agrees, row["delta_ms"] > 0
    if peers:
        size = math.nan if tested is None else tested / 100.0 * row["judged_ms"][0]
        row["peer_delta_pct"], row["peer_delta_ms"] = tested, size
        relative = tested is not None and abs(tested) >= th.min_pct and abs(size) >= th.min_ms
        matters, up = relative and (matters or peers > 1), size > 0
    found = p < th.max_p and matters
    # Big enough to matter, but too few independent blocks to judge: said so, never "no change".
    undecided = matters and not found and min(blocks) < MIN_BLOCKS
    return {**row, REGRESSION: found and up, IMPROVEMENT: found and not up, UNDECIDED: undecided}


def _pct(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return 100.0 * (b - a) / a


def _summary(values: np.ndarray) -> dict[str, Any]:
    p50, p95 = quantiles(values, (0.5, 0.95))
    return {"count": int(values.size), "p50_ms": None if values.size == 0 else p50,
            "p95_ms": None if values.size == 0 else p95}


def _window(steps_a: np.ndarray, steps_b: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(the steps to compare, or None for all; the steps both runs have)."""
    shared = np.intersect1d(steps_a, steps_b)
    # Only the shared steps, unless there are none, or they are all either run has (nothing to drop).
    return (shared if shared.size and shared.size < max(steps_a.size, steps_b.size) else None), shared


def diff_runs(a: Run, b: Run, thresholds: Thresholds = Thresholds(), sync: Sequence[str] = SYNC_PHASES,
              baselines: Sequence[Run] = ()) -> dict[str, Any]:
    """The ``diff --json`` object: phases, ranks, findings (regressions first), steps, thresholds.
    ``baselines``: more runs of A's kind, against whose spread a change of all ranks is judged too
    (the module doc); at least ``MIN_RUNS - 1`` of them, or none."""
    if baselines and len(baselines) < MIN_RUNS - 1:
        raise ValueError(f"{len(baselines)} more run(s) of A: at least {MIN_RUNS - 1} are needed to measure "
                         "the spread of A's runs")
    steps_a, steps_b = _steps_of(a), _steps_of(b)
    steps, shared = _window(steps_a, steps_b)
    (raw_a, judged_a), (raw_b, judged_b) = _samples(a, steps, sync), _samples(b, steps, sync)
    order = list(dict.fromkeys([*a.phase_order(), *b.phase_order()]))
    names = [n for n in order if any(k[1] == n for k in raw_a) and any(k[1] == n for k in raw_b)]
    collective = {n for n in names if n in sync or schema.comm_op_of(n)}
    containers = {p for run in (a, b) for d in run.processes for p in d.parents.values() if p is not None}
    tested = [{n: _tested(judged, n) for n in names} for judged in (judged_a, judged_b)]
    ranks = _rank_rows(raw_a, raw_b, judged_a, judged_b, tested, names, thresholds)
    _without_the_changed(ranks, (judged_a, judged_b), thresholds)
    for row in ranks:
        if row["phase"] in collective:  # judged for the group only (see _findings)
            row[REGRESSION] = row[IMPROVEMENT] = False
    phases = []
    for name in names:
        ra, rb = _pooled(raw_a, name), _pooled(raw_b, name)
        phases.append({"name": name, "a": _summary(ra), "b": _summary(rb), "delta_p50_pct": _pct(_p50(ra), _p50(rb)),
                       **_verdict(_pooled(judged_a, name), _pooled(judged_b, name),
                                  *(t[name].get(None, _NONE) for t in tested), thresholds),
                       "collective": name in collective, "container": name in containers})
    if baselines:
        _between_runs(phases, [_run_medians(run, steps_b, sync) for run in baselines], thresholds)
    else:
        _one_launch(phases)
    return {
        "phases": phases,
        "ranks": ranks,
        "findings": _findings(phases, ranks, thresholds),
        UNDECIDED: _undecided(phases, ranks),
        "steps": {"a": int(steps_a.size), "b": int(steps_b.size), "shared": int(shared.size)},
        "thresholds": {"max_p": thresholds.max_p, "min_pct": thresholds.min_pct, "min_ms": thresholds.min_ms},
        "a_runs": 1 + len(baselines),
    }


def _run_medians(run: Run, steps_b: np.ndarray, sync: Sequence[str]) -> dict[str, float]:
    """One more run of A's kind: each phase's judged median, on the steps it shares with B."""
    steps, _ = _window(_steps_of(run), steps_b)
    _, judged = _samples(run, steps, sync)
    names = {name for _, name in judged}
    return {n: float(np.median(v)) for n in names if (v := _pooled(judged, n)).size}


def _between_runs(phases: list[dict[str, Any]], more: list[dict[str, float]], th: Thresholds) -> None:
    """Judges each phase row (all ranks) against the spread of A's runs as well (the module doc): adds
    ``runs`` (the A runs' medians, the bound, whether B is outside it), and a regression, an
    improvement or an undecided change inside the bound is none: A's runs differ as much. A phase that fewer than ``MIN_RUNS`` A runs have keeps the
    pair's verdict, with ``bound_ms`` null."""
    for ph in phases:
        a50, b50 = ph["judged_ms"]
        medians = [m for m in [a50, *(run.get(ph["name"]) for run in more)] if m is not None]
        if len(medians) < MIN_RUNS or b50 is None:
            ph["runs"] = {"a_p50_ms": medians, "bound_ms": None, "outside": None}
            continue
        n = len(medians)
        spread = float(np.std(medians, ddof=1))
        bound = student_t_isf(th.max_p / 2.0, n - 1) * spread * math.sqrt(1.0 + 1.0 / n)
        outside = bool(abs(b50 - float(np.mean(medians))) > bound)
        ph["runs"] = {"a_p50_ms": medians, "bound_ms": bound, "outside": outside}
        if not outside:
            ph[REGRESSION] = ph[IMPROVEMENT] = ph[UNDECIDED] = False


def _one_launch(phases: list[dict[str, Any]]) -> None:
    """Without more runs of A: a collective's significant change of its own time is undecided, not a
    finding (the module doc). Beside a busy loop a clean 2-rank job's all-reduce took 1.34 ms in one
    launch and 3.86 ms in another, steady within each (docs/analysis.md "Diff")."""
    for ph in phases:
        if ph["collective"] and (ph[REGRESSION] or ph[IMPROVEMENT]):
            ph[REGRESSION] = ph[IMPROVEMENT] = False
            ph[UNDECIDED], ph[REASON] = True, ONE_RUN


def _rank_rows(raw_a: Samples, raw_b: Samples, judged_a: Keyed, judged_b: Keyed,
               tested: list[dict[str, dict[int | None, np.ndarray]]], names: list[str], th: Thresholds
               ) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        for rank in sorted({r for r, n in raw_a if n == name} & {r for r, n in raw_b if n == name}):
            a50, b50 = _p50(raw_a[(rank, name)]), _p50(raw_b[(rank, name)])
            rows.append({"rank": rank, "phase": name, "a_p50_ms": a50, "b_p50_ms": b50, "delta_pct": _pct(a50, b50),
                         **_verdict(judged_a.get((rank, name), (_NONE, _NONE))[1],
                                    judged_b.get((rank, name), (_NONE, _NONE))[1],
                                    *(t[name].get(rank, _NONE) for t in tested), th,
                                    peers=max(1, len(tested[0][name]) - 2))})
    return rows


def _big(row: dict[str, Any], th: Thresholds) -> bool:
    base, delta = row["judged_ms"][0], row["delta_ms"]
    return delta == delta and base is not None and abs(delta) >= th.min_ms and abs(delta) >= th.min_pct / 100.0 * abs(base)


def _findings(phases: list[dict[str, Any]], ranks: list[dict[str, Any]], th: Thresholds) -> list[dict[str, Any]]:
    """One finding for a phase that changed on most of its ranks alike (each by enough to matter),
    and one per rank whose own change (against its peers) is a finding. A collective is one operation
    of the group, judged for all ranks together (which rank leaves it last changes from run to run).
    None for a phase that contains others (``step``): its change is theirs."""
    out = []
    for ph in (ph for ph in phases if not ph["container"]):
        mine = [r for r in ranks if r["phase"] == ph["name"]]
        kind = REGRESSION if ph["regression"] else IMPROVEMENT if ph["improvement"] else None
        alike = [r for r in mine if kind and _big(r, th) and (r["delta_ms"] > 0) == (kind == REGRESSION)]
        if kind and (ph["collective"] or not mine or 2 * len(alike) > len(mine)):
            out.append(_finding(kind, ph["name"], None, ph, ph["collective"]))
        for r in mine if not ph["collective"] else ():
            if r[REGRESSION] or r[IMPROVEMENT]:
                out.append(_finding(REGRESSION if r[REGRESSION] else IMPROVEMENT, ph["name"], r["rank"], r,
                                    ph["collective"]))
    return sorted(out, key=lambda f: (f["kind"] != REGRESSION, -abs(f["delta_ms"])))


def _finding(kind: str, phase: str, rank: int | None, row: dict[str, Any], collective: bool) -> dict[str, Any]:
    who = "all ranks" if rank is None else f"rank {rank}"
    own = " (its own time, waiting for peers excluded)" if collective else ""
    a50, b50 = row["judged_ms"]
    pct = _pct(a50, b50)
    change = f"{row['delta_ms']:+.2f} ms" + (f", {pct:+.0f} %" if pct is not None else "")
    runs = row.get("runs") or {}
    spread = (f", outside the spread of {len(runs['a_p50_ms'])} runs of A (+/-{runs['bound_ms']:.3g} ms)"
              if runs.get("bound_ms") is not None else "")
    delta = row["delta_ms"]
    if row.get("peer_delta_pct") is not None:  # a rank judged against its peers: that change is the finding's
        pct, delta = row["peer_delta_pct"], row["peer_delta_ms"]
        change += f"; over its peers at the same steps {pct:+.0f} %, {delta:+.2f} ms"
    message = (f"{phase} on {who}{own}: median {a50:.3g} -> {b50:.3g} ms ({change}), "
               f"Mann-Whitney p={row['p_value']:.1g} over blocks of steps{spread}")
    return {"kind": kind, "phase": phase, "rank": rank, "message": message, "delta_ms": delta,
            "delta_pct": pct, "p_value": row["p_value"]}


def _undecided(phases: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Changes big enough to matter that could not be judged: a series with fewer than
    :data:`MIN_BLOCKS` independent blocks of steps (a short run, or one whose times drift). Per rank
    where the phase is judged per rank; for all ranks where it is judged for the group (a collective)
    or no rank was. Largest change first. They are no findings, and they are never "no change"."""
    out = []
    for ph in (ph for ph in phases if not ph["container"]):
        mine = [] if ph["collective"] else [r for r in ranks if r["phase"] == ph["name"]]
        if mine:
            rows = [(r["rank"], r) for r in mine if r[UNDECIDED]]
        else:
            rows = [(None, ph)] if ph[UNDECIDED] else []
        for rank, row in rows:
            why = row.get(REASON, FEW_BLOCKS)
            out.append({"phase": ph["name"], "rank": rank, "message": _undecided_message(ph["name"], rank, row, why),
                        "delta_ms": row["delta_ms"], "blocks": row["blocks"], "reason": why})
    return sorted(out, key=lambda u: -abs(u["delta_ms"]))


def _undecided_message(phase: str, rank: int | None, row: dict[str, Any], why: str) -> str:
    who = "all ranks" if rank is None else f"rank {rank}"
    a50, b50 = row["judged_ms"]
    change = f"median {a50:.3g} -> {b50:.3g} ms ({row['delta_ms']:+.2f} ms)"
    if why == ONE_RUN:
        return (f"{phase} on {who} (its own time, waiting for peers excluded): {change}, p={row['p_value']:.1g}, but a "
                f"collective's own time is drawn once per launch (placement, what shares the links): one run of A "
                f"cannot tell that from a change; judge it with --baseline (two more runs of A)")
    na, nb = row["blocks"]
    return (f"{phase} on {who}: {change}, but only {na} and {nb} independent blocks of steps in A and B "
            f"({MIN_BLOCKS} needed on each side): not judged; compare longer runs")
