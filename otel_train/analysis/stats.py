"""Phase statistics: per phase × rank, per step (with idle time), and straggler scores vs. peers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from otel_train.analysis.spans import NO_STEP, ProcessState, Run, load_run
from otel_train.phases import STEP


def quantiles(values: np.ndarray, qs: Sequence[float]) -> list[float]:
    """Quantiles interpolated linearly (numpy's and DuckDB's ``quantile_cont``); NaN when empty."""
    if values.size == 0:
        return [math.nan] * len(qs)
    return [float(x) for x in np.quantile(values, qs)]


def median(values: Sequence[float]) -> float:
    """Median of values (NaN when empty)."""
    return quantiles(np.asarray(values, dtype=float), (0.5,))[0]


def columns(d: ProcessState, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, ms, end times) of one phase's closed spans, zero-copy views of the state's arrays."""
    series = d.phases.get(phase)
    if series is None or not series.durs:
        return np.empty(0, np.int64), np.empty(0, np.float64), np.empty(0, np.float64)
    return (np.frombuffer(series.steps, dtype=np.int64), np.frombuffer(series.durs, dtype=np.float64),
            np.frombuffer(series.ends, dtype=np.float64))


def durations(d: ProcessState, phase: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, ms) columns of one phase's closed spans (see :func:`columns`)."""
    steps, durs, _ = columns(d, phase)
    return steps, durs


def per_step(d: ProcessState, phase: str) -> tuple[np.ndarray, np.ndarray]:
    """(unique steps ascending, total ms in ``phase`` per step): several spans of one step add up."""
    steps, durs = durations(d, phase)
    if steps.size and steps[0] != NO_STEP and (steps.size == 1 or bool((steps[1:] > steps[:-1]).all())):
        return steps, durs  # one span a step, in order (the common case): no sort (1,024 ranks x 10 phases)
    keep = steps != NO_STEP
    steps, durs = steps[keep], durs[keep]
    uniq, inverse = np.unique(steps, return_inverse=True)
    return uniq, np.bincount(inverse, weights=durs, minlength=uniq.size)


def step_axis(group: Sequence[ProcessState], phases: Iterable[str]) -> np.ndarray:
    """Every step any process of the group recorded in any of ``phases``, ascending."""
    cols = [per_step(d, p)[0] for d in group for p in phases]
    return np.unique(np.concatenate(cols)) if cols else np.empty(0, np.int64)


def align(axis: np.ndarray, steps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` (at ascending ``steps``) placed on ``axis``; NaN where a step has no value."""
    out = np.full(axis.size, np.nan)
    idx = np.searchsorted(axis, steps)
    ok = idx < axis.size
    ok[ok] = axis[idx[ok]] == steps[ok]
    out[idx[ok]] = values[ok]
    return out


@dataclass(slots=True)
class PeerTable:
    """One phase across a group, step by step: ``durs[i, j]`` is process j's ms at ``steps[i]``.

    ``peers[i, j]`` is the median of the *other* processes' values at that step. Both are NaN where
    process j has no value or fewer than two processes have one.
    """

    phase: str
    steps: np.ndarray
    durs: np.ndarray
    peers: np.ndarray


def peer_table(group: Sequence[ProcessState], phase: str, steps: np.ndarray | None = None) -> PeerTable:
    """Compare every process with the median of its peers at the same step (on ``steps`` if given)."""
    axis = step_axis(group, [phase]) if steps is None else steps
    durs = np.full((axis.size, len(group)), np.nan)
    for j, d in enumerate(group):
        durs[:, j] = align(axis, *per_step(d, phase))
    shared = (~np.isnan(durs)).sum(axis=1) >= 2
    durs[~shared] = np.nan
    return PeerTable(phase, axis, durs, peer_medians(durs))


def peer_medians(m: np.ndarray) -> np.ndarray:
    """For each cell, the median of the other non-NaN cells of its row (NaN where the cell is NaN)."""
    rows, width = m.shape
    if rows == 0 or width == 0:
        return m.copy()
    valid = ~np.isnan(m)
    others = valid.sum(axis=1, keepdims=True) - 1
    order = np.argsort(m, axis=1)  # NaN last
    ordered = np.take_along_axis(m, order, axis=1)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(width), m.shape), axis=1)

    def other(i: np.ndarray) -> np.ndarray:
        # The i-th smallest of the others: skip the cell's own slot in the sorted row.
        j = np.clip(np.where(i < pos, i, i + 1), 0, width - 1)
        return np.take_along_axis(ordered, j, axis=1)

    lo = np.broadcast_to((others - 1) // 2, m.shape)
    hi = np.broadcast_to(others // 2, m.shape)
    out = (other(lo) + other(hi)) / 2.0
    out[~valid | (others < 1)] = np.nan
    return out


def straggler_scores(table: PeerTable) -> list[float | None]:
    """Per process: median over steps of (own ms / peer median ms); None without comparable steps."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = table.durs / table.peers
    ratio[~np.isfinite(ratio)] = np.nan
    out: list[float | None] = []
    for j in range(ratio.shape[1]):
        col = ratio[:, j]
        col = col[~np.isnan(col)]
        out.append(float(np.median(col)) if col.size else None)
    return out


def phase_rows(run: Run) -> list[dict[str, Any]]:
    """``compute_stats(run)["phases"]``."""
    rows = []
    order = {name: i for i, name in enumerate(run.phase_order())}
    for d in run.processes:
        for name in sorted(d.phases, key=lambda n: order.get(n, len(order))):
            _, durs = durations(d, name)
            if not durs.size:
                continue
            p50, p95 = quantiles(durs, (0.5, 0.95))
            rows.append(
                {
                    "name": name,
                    "rank": d.rank,
                    "attempt": d.attempt,
                    "source": d.source,
                    "count": int(durs.size),
                    "mean_ms": float(durs.mean()),
                    "p50_ms": p50,
                    "p95_ms": p95,
                    "max_ms": float(durs.max()),
                }
            )
    return rows


def _step_rows(run: Run) -> list[dict[str, Any]]:
    return [row for d in run.processes for row in process_step_rows(d)]


def process_step_rows(d: ProcessState) -> list[dict[str, Any]]:
    """One process's rows of ``compute_stats(run)["steps"]``, in the same order (a process at a time:
    the CLI encodes 216,000 rows of a 1 GB run without holding them all as dicts)."""
    steps, totals = per_step(d, STEP)
    children = [name for name, parent in d.parents.items() if parent == STEP and name in d.phases]
    cols = [(name, align(steps, *per_step(d, name)).tolist()) for name in children]
    covered = np.zeros(steps.size)
    for _, col in cols:
        covered += np.nan_to_num(np.asarray(col))
    idle = np.maximum(totals - covered, 0.0).tolist()
    renumbered = d.renumbered  # asked once: it looks at every epoch
    rows = []
    for i, (step, total) in enumerate(zip(steps.tolist(), totals.tolist())):
        row = {
            "rank": d.rank,
            "attempt": d.attempt,
            "source": d.source,
            "step": step,
            "step_ms": total,
            "phases": {name: col[i] for name, col in cols if col[i] == col[i]},
            "idle_ms": idle[i],
        }
        original = d.epoch_step(step) if renumbered else None  # steps repeated every epoch: (epoch, step)
        if original is not None:
            row["epoch"], row["epoch_step"] = original
        rows.append(row)
    return rows


def score_rows(run: Run) -> list[dict[str, Any]]:
    """``compute_stats(run)["straggler_scores"]``."""
    rows = []
    order = run.phase_order()
    for group in run.groups():
        if len(group) < 2:
            continue
        for name in (n for n in order if any(n in d.phases for d in group)):
            for d, score in zip(group, straggler_scores(peer_table(group, name))):
                if score is not None:
                    rows.append(
                        {"phase": name, "rank": d.rank, "attempt": d.attempt, "source": d.source, "score": score}
                    )
    return rows


def compute_stats(run: Run) -> dict[str, Any]:
    """Stats of a loaded run as a JSON-ready dict.

    ``phases``: per phase × process count/mean/p50/p95/max; ``steps``: per process and step the step
    time, its child phases and ``idle_ms`` (step time no child phase covers); ``straggler_scores``:
    per phase × process, median over steps of its duration divided by the median of its peers at
    the same step (1.0 = typical, 2.0 = twice as slow).
    """
    return {
        "phases": phase_rows(run),
        "steps": _step_rows(run),
        "straggler_scores": score_rows(run),
        "malformed_lines": run.malformed_lines,
    }


def stats(path: str | Path, **load_kwargs: Any) -> dict[str, Any]:
    """``compute_stats(load_run(path, **load_kwargs))``; raises TraceReadError for a path without traces."""
    return compute_stats(load_run(path, **load_kwargs))


# ---------------------------------------------------------------------------------------------
# Significance tests (exact binomial tail, Mann–Whitney U): small and numpy-only, checked in
# tests/test_stats.py against values computed by hand and by exhaustive enumeration.


def binom_sf(k: int, n: int, p: float = 0.5) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed exactly in log space (1.0 for k <= 0, 0.0 for k > n)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0 or p >= 1.0:
        return float(p >= 1.0)
    # log pmf(k), then pmf(i + 1) / pmf(i) = (n - i) / (i + 1) * p / (1 - p), accumulated.
    first = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
             + k * math.log(p) + (n - k) * math.log1p(-p))
    i = np.arange(k, n, dtype=float)
    steps = np.log((n - i) / (i + 1)) + math.log(p) - math.log1p(-p)
    log_pmf = first + np.concatenate([[0.0], np.cumsum(steps)])
    top = float(log_pmf.max())
    return float(min(1.0, math.exp(top) * np.exp(log_pmf - top).sum()))


def sign_test(greater: int, n: int) -> float:
    """One-sided sign test: the chance of ``greater`` or more of ``n`` coin flips landing heads."""
    return binom_sf(greater, n, 0.5)


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mann–Whitney U test of ``b`` against ``a``: (U of ``b``, two-sided p).

    Normal approximation with the tie correction and a continuity correction (scipy's
    ``method="asymptotic"``); it holds for skewed durations since only ranks count. p is NaN when
    either sample is empty, 1.0 when every value is tied.
    """
    n1, n2 = a.size, b.size
    if n1 == 0 or n2 == 0:
        return math.nan, math.nan
    both = np.concatenate([a, b])
    order = np.argsort(both)  # tied values get their average rank below, so any sort order does
    ordered = both[order]
    # Average ranks of tied runs: each run [start, end) gets (start + end + 1) / 2.
    edges = np.flatnonzero(np.diff(ordered)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [ordered.size]])
    ranks = np.empty(both.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    u = float(ranks[n1:].sum() - n2 * (n2 + 1) / 2.0)
    ties = (ends - starts).astype(float)
    n = float(n1 + n2)
    var = n1 * n2 / 12.0 * ((n + 1) - float((ties**3 - ties).sum()) / (n * (n - 1)))
    if var <= 0:
        return u, 1.0
    z = (abs(u - n1 * n2 / 2.0) - 0.5) / math.sqrt(var)
    return u, min(1.0, 2.0 * normal_sf(max(z, 0.0)))


def _beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz), for x < (a+1)/(a+b+2)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    out = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            out *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return out


def incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if x <= 0.0 or x >= 1.0:
        return float(x >= 1.0)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(x, a, b) / a
    return 1.0 - front * _beta_fraction(1.0 - x, b, a) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return tail if t >= 0 else 1.0 - tail


def student_t_isf(p: float, df: float) -> float:
    """The t with P(T > t) = p (0 < p < 0.5), by bisection on :func:`student_t_sf`."""
    lo, hi = 0.0, 1.0
    while student_t_sf(hi, df) > p:
        lo, hi = hi, 2.0 * hi
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if student_t_sf(mid, df) > p else (lo, mid)
    return 0.5 * (lo + hi)
