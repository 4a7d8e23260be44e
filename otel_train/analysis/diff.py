"""Diff: run B against run A, per phase and per rank x phase, with a significance test.

Durations are compared on the steps both runs have (by step number) when they share any, else on
all steps. Each comparison reports p50/p95 in both runs, the change of the median, and the
two-sided Mann–Whitney U p-value (ranks only, so skewed durations are fine). A change is a finding
only when it is both significant (p < ``max_p``) and big enough to matter (at least ``min_pct`` of
A's median and ``min_ms``).

Culprits, not victims: time a rank spends in a collective phase (``backward``) waiting for a late
peer is not that phase's work, so collective phases are judged on their own time (the what-if
model's tail: from the last rank's arrival to leaving; docs/analysis.md "What-if"), a change
that most ranks of a phase share is one finding for all ranks instead of one per rank, and a phase
that contains others (``step``) gets none: its change is theirs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from otel_train.analysis.spans import NO_STEP, Run
from otel_train.analysis.stats import mann_whitney, quantiles
from otel_train.analysis.whatif import SYNC_PHASES, sync_table

REGRESSION = "regression"
IMPROVEMENT = "improvement"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a change is a finding: p below ``max_p``, and at least ``min_pct`` % and ``min_ms`` ms."""

    max_p: float = 0.01
    min_pct: float = 5.0
    min_ms: float = 0.5


Samples = dict[tuple[int, str], np.ndarray]


def _steps_of(run: Run) -> np.ndarray:
    cols = [np.frombuffer(s.steps, np.int64) for d in run.processes for s in d.phases.values() if s.steps]
    steps = np.unique(np.concatenate(cols)) if cols else np.empty(0, np.int64)
    return steps[steps != NO_STEP]


def _durations(run: Run, steps: np.ndarray | None) -> Samples:
    """Per (rank, phase): its span durations (all attempts), of ``steps`` when given."""
    out: dict[tuple[int, str], list[np.ndarray]] = {}
    for d in run.processes:
        for name, s in d.phases.items():
            durs = np.frombuffer(s.durs, np.float64)
            if steps is not None:
                at = np.frombuffer(s.steps, np.int64)
                durs = durs[(at == NO_STEP) | np.isin(at, steps)]
            out.setdefault((d.rank, name), []).append(durs)
    return {k: np.concatenate(v) for k, v in out.items()}


def _own_times(run: Run, steps: np.ndarray | None, sync: Sequence[str]) -> Samples:
    """Per (rank, collective phase): its own time in the collective, waiting excluded (what-if tails)."""
    out: dict[tuple[int, str], list[np.ndarray]] = {}
    for group in run.groups():
        table = sync_table(group, sync)
        if table is None:
            continue
        prev = table.keys[:-1]
        for i, name in enumerate(table.sync):
            rows = prev % len(table.sync) == i
            if steps is not None:
                rows &= np.isin(prev // len(table.sync), steps)
            col = table.work[1:, :, table.phases.index(name)][rows]
            for j, rank in enumerate(table.ranks):
                out.setdefault((rank, name), []).append(col[:, j])
    return {k: np.concatenate(v) for k, v in out.items()}


def _samples(run: Run, steps: np.ndarray | None, sync: Sequence[str]) -> tuple[Samples, Samples]:
    """(raw durations, judged values): collective phases are judged on their own time."""
    raw = _durations(run, steps)
    return raw, {**raw, **_own_times(run, steps, sync)}


def _pooled(samples: Samples, phase: str) -> np.ndarray:
    cols = [v for (_, name), v in samples.items() if name == phase]
    return np.concatenate(cols) if cols else np.empty(0)


def _p50(values: np.ndarray) -> float | None:
    return quantiles(values, (0.5,))[0] if values.size else None


def _verdict(a: np.ndarray, b: np.ndarray, th: Thresholds) -> dict[str, Any]:
    """The test of judged values: p_value, the medians (judged_ms) and their change (delta_ms), and
    whether that is a ``regression`` or an ``improvement``."""
    if not a.size or not b.size:
        return {"p_value": math.nan, "delta_ms": math.nan, "judged_ms": [_p50(a), _p50(b)],
                REGRESSION: False, IMPROVEMENT: False}
    _, p = mann_whitney(a, b)
    row = {"p_value": p, "delta_ms": float(np.median(b) - np.median(a)),
           "judged_ms": [float(np.median(a)), float(np.median(b))]}
    found = p < th.max_p and _big(row, th)
    return {**row, REGRESSION: found and row["delta_ms"] > 0, IMPROVEMENT: found and row["delta_ms"] < 0}


def _pct(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return 100.0 * (b - a) / a


def _summary(values: np.ndarray) -> dict[str, Any]:
    p50, p95 = quantiles(values, (0.5, 0.95))
    return {"count": int(values.size), "p50_ms": None if values.size == 0 else p50,
            "p95_ms": None if values.size == 0 else p95}


def diff_runs(a: Run, b: Run, thresholds: Thresholds = Thresholds(), sync: Sequence[str] = SYNC_PHASES
              ) -> dict[str, Any]:
    """The ``diff --json`` object: phases, ranks, findings (regressions first), steps, thresholds."""
    steps_a, steps_b = _steps_of(a), _steps_of(b)
    shared = np.intersect1d(steps_a, steps_b)
    # Only the shared steps, unless there are none, or they are all either run has (nothing to drop).
    steps = shared if shared.size and shared.size < max(steps_a.size, steps_b.size) else None
    (raw_a, judged_a), (raw_b, judged_b) = _samples(a, steps, sync), _samples(b, steps, sync)
    order = list(dict.fromkeys([*a.phase_order(), *b.phase_order()]))
    names = [n for n in order if any(k[1] == n for k in raw_a) and any(k[1] == n for k in raw_b)]
    collective = {n for n in sync if n in names}
    containers = {p for run in (a, b) for d in run.processes for p in d.parents.values() if p is not None}
    ranks = _rank_rows(raw_a, raw_b, judged_a, judged_b, names, thresholds)
    for row in ranks:
        if row["phase"] in collective:  # judged for the group only (see _findings)
            row[REGRESSION] = row[IMPROVEMENT] = False
    phases = []
    for name in names:
        ra, rb = _pooled(raw_a, name), _pooled(raw_b, name)
        phases.append({"name": name, "a": _summary(ra), "b": _summary(rb), "delta_p50_pct": _pct(_p50(ra), _p50(rb)),
                       **_verdict(_pooled(judged_a, name), _pooled(judged_b, name), thresholds),
                       "collective": name in collective, "container": name in containers})
    return {
        "phases": phases,
        "ranks": ranks,
        "findings": _findings(phases, ranks, thresholds),
        "steps": {"a": int(steps_a.size), "b": int(steps_b.size), "shared": int(shared.size)},
        "thresholds": {"max_p": thresholds.max_p, "min_pct": thresholds.min_pct, "min_ms": thresholds.min_ms},
    }


def _rank_rows(raw_a: Samples, raw_b: Samples, judged_a: Samples, judged_b: Samples, names: list[str],
               th: Thresholds) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        for rank in sorted({r for r, n in raw_a if n == name} & {r for r, n in raw_b if n == name}):
            a50, b50 = _p50(raw_a[(rank, name)]), _p50(raw_b[(rank, name)])
            rows.append({"rank": rank, "phase": name, "a_p50_ms": a50, "b_p50_ms": b50, "delta_pct": _pct(a50, b50),
                         **_verdict(judged_a.get((rank, name), np.empty(0)),
                                    judged_b.get((rank, name), np.empty(0)), th)})
    return rows


def _big(row: dict[str, Any], th: Thresholds) -> bool:
    base, delta = row["judged_ms"][0], row["delta_ms"]
    return delta == delta and base is not None and abs(delta) >= th.min_ms and abs(delta) >= th.min_pct / 100.0 * abs(base)


def _findings(phases: list[dict[str, Any]], ranks: list[dict[str, Any]], th: Thresholds) -> list[dict[str, Any]]:
    """One finding for a phase that changed on most of its ranks alike (each by enough to matter),
    else one per rank whose own change is a finding. A collective is one operation of the group,
    judged for all ranks together (which rank leaves it last changes from run to run). None for a
    phase that contains others (``step``): its change is theirs."""
    out = []
    for ph in (ph for ph in phases if not ph["container"]):
        mine = [r for r in ranks if r["phase"] == ph["name"]]
        kind = REGRESSION if ph["regression"] else IMPROVEMENT if ph["improvement"] else None
        alike = [r for r in mine if kind and _big(r, th) and (r["delta_ms"] > 0) == (kind == REGRESSION)]
        if kind and (ph["collective"] or not mine or 2 * len(alike) > len(mine)):
            out.append(_finding(kind, ph["name"], None, ph, ph["collective"]))
            continue
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
    message = (f"{phase} on {who}{own}: median {a50:.3g} -> {b50:.3g} ms ({change}), "
               f"Mann-Whitney p={row['p_value']:.1g}")
    return {"kind": kind, "phase": phase, "rank": rank, "message": message, "delta_ms": row["delta_ms"],
            "delta_pct": pct, "p_value": row["p_value"]}
