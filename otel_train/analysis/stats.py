"""Phase statistics: per phase × rank, per step (with idle time), and straggler scores vs. peers."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.analysis.digest import NO_STEP, ProcessDigest, Run, load_run
from otel_train.phases import STEP


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending values, interpolated linearly (numpy's and DuckDB's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """Median of unsorted values."""
    return quantile(sorted(values), 0.5)


def groups(run: Run) -> Iterator[list[ProcessDigest]]:
    """Processes that ran together: one list per (source, attempt), ranks ascending."""
    by_key: dict[tuple[str, int], list[ProcessDigest]] = {}
    for d in run.processes:
        by_key.setdefault((d.source, d.attempt), []).append(d)
    for key in sorted(by_key):
        yield by_key[key]


def per_step(d: ProcessDigest, phase: str) -> dict[int, float]:
    """Step -> total ms spent in ``phase`` during that step (several spans of one step add up)."""
    out: dict[int, float] = {}
    series = d.phases.get(phase)
    if series is None:
        return out
    for step, dur in zip(series.steps, series.durs):
        if step != NO_STEP:
            out[step] = out.get(step, 0.0) + dur
    return out


@dataclass(slots=True)
class PeerTable:
    """Durations of one phase per shared step across a group's processes, with each one's peer median.

    ``durs[i][j]`` is process j's ms at ``steps[i]`` (None when it has none); ``peers[i][j]`` is the
    median of the *other* processes' values at that step (None where j has no value).
    """

    phase: str
    steps: list[int]
    durs: list[list[float | None]]
    peers: list[list[float | None]]


def peer_table(group: Sequence[ProcessDigest], phase: str) -> PeerTable:
    """Compare every process against the median of its peers, step by step (steps with ≥ 2 values)."""
    columns = [per_step(d, phase) for d in group]
    all_steps = sorted(set().union(*columns)) if columns else []
    steps: list[int] = []
    durs: list[list[float | None]] = []
    peers: list[list[float | None]] = []
    for step in all_steps:
        row = [col.get(step) for col in columns]
        present = [v for v in row if v is not None]
        if len(present) < 2:
            continue
        steps.append(step)
        durs.append(row)
        peers.append(_peer_medians(row, sorted(present)))
    return PeerTable(phase, steps, durs, peers)


def _peer_medians(row: list[float | None], ordered: list[float]) -> list[float | None]:
    # Median of the others = median of ``ordered`` with one copy of the own value removed.
    n = len(ordered) - 1
    out: list[float | None] = []
    for v in row:
        if v is None:
            out.append(None)
            continue
        k = ordered.index(v)

        def at(i: int) -> float:
            return ordered[i] if i < k else ordered[i + 1]

        out.append(at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2.0)
    return out


def straggler_scores(table: PeerTable) -> list[float | None]:
    """Per process: median over steps of (own ms / peer median ms); None without comparable steps."""
    width = len(table.durs[0]) if table.durs else 0
    out: list[float | None] = []
    for j in range(width):
        ratios = [
            row[j] / ref[j]  # type: ignore[operator]
            for row, ref in zip(table.durs, table.peers)
            if row[j] is not None and ref[j]
        ]
        out.append(median(ratios) if ratios else None)
    return out


def _phase_rows(run: Run) -> list[dict[str, Any]]:
    rows = []
    order = {name: i for i, name in enumerate(run.phase_order())}
    for d in run.processes:
        for name in sorted(d.phases, key=lambda n: order.get(n, len(order))):
            durs = sorted(d.phases[name].durs)
            rows.append(
                {
                    "name": name,
                    "rank": d.rank,
                    "attempt": d.attempt,
                    "source": d.source,
                    "count": len(durs),
                    "mean_ms": sum(durs) / len(durs),
                    "p50_ms": quantile(durs, 0.5),
                    "p95_ms": quantile(durs, 0.95),
                    "max_ms": durs[-1],
                }
            )
    return rows


def _step_rows(run: Run) -> list[dict[str, Any]]:
    rows = []
    for d in run.processes:
        steps = per_step(d, STEP)
        children = [name for name, parent in d.parents.items() if parent == STEP and name in d.phases]
        child_steps = {name: per_step(d, name) for name in children}
        for step in sorted(steps):
            phases = {name: col[step] for name, col in child_steps.items() if step in col}
            total = steps[step]
            rows.append(
                {
                    "rank": d.rank,
                    "attempt": d.attempt,
                    "source": d.source,
                    "step": step,
                    "step_ms": total,
                    "phases": phases,
                    "idle_ms": max(total - sum(phases.values()), 0.0),
                }
            )
    return rows


def _score_rows(run: Run) -> list[dict[str, Any]]:
    rows = []
    order = run.phase_order()
    for group in groups(run):
        if len(group) < 2:
            continue
        names = [n for n in order if any(n in d.phases for d in group)]
        for name in names:
            table = peer_table(group, name)
            for d, score in zip(group, straggler_scores(table)):
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
        "phases": _phase_rows(run),
        "steps": _step_rows(run),
        "straggler_scores": _score_rows(run),
        "malformed_lines": run.malformed_lines,
    }


def stats(path: str | Path, **load_kwargs: Any) -> dict[str, Any]:
    """``compute_stats(load_run(path, **load_kwargs))``; raises TraceReadError for a path without traces."""
    return compute_stats(load_run(path, **load_kwargs))
