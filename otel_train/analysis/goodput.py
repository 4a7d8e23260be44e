"""Goodput: how much of a run's wall time went into training steps that counted.

The wall time runs from the first process start to the last record, on the hosts' clocks. Each
moment of it is counted once, under the first of these that covers it on any rank
(docs/analysis.md "Goodput"):

1. ``restart``: between two attempts, when no process of either was running (restart downtime);
2. ``checkpoint`` and 3. ``eval``: spans of those names;
4. ``init``: from an attempt's first record to its first step;
5. ``lost``: steps that a later attempt did again (their work was thrown away);
6. ``productive``: the other completed steps.

The rest (``other``: after the last step, hung or failed steps nobody redid, gaps between steps
outside any span) is what is left, so the parts never add up to more than the wall time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from otel_train.analysis.spans import NO_STEP, ProcessState, Run
from otel_train.analysis.stats import columns
from otel_train.phases import CHECKPOINT, EVAL, STEP

Intervals = tuple[np.ndarray, np.ndarray]
LAYERS = ("restart", "checkpoint", "eval", "init", "lost", "productive")


def goodput(run: Run) -> dict[str, Any]:
    """The ``goodput`` object of ``summarize --json``: wall_s, productive_s, fraction, init_s,
    checkpoint_s, eval_s, lost_s, restart_s, other_s (seconds; fraction = productive / wall)."""
    procs = [d for d in run.processes if d.first_ts is not None and d.last_ts is not None]
    if not procs:
        return {"wall_s": 0.0, "productive_s": 0.0, "fraction": None, **{f"{k}_s": 0.0 for k in LAYERS[:-1]},
                "other_s": 0.0}
    t0 = min(d.first_ts for d in procs)  # type: ignore[type-var]
    t1 = max(d.last_ts for d in procs)  # type: ignore[type-var]
    layers: dict[str, list[Intervals]] = {k: [] for k in LAYERS}
    for attempts in _attempts(procs).values():
        _attempt_layers(attempts, layers)
    for d in procs:
        for name in (CHECKPOINT, EVAL):
            layers[name].append(_closed(d, name))
    parts = dict(zip(LAYERS, _measure([_concat(layers[k]) for k in LAYERS], t0, t1)))
    wall = t1 - t0
    return {
        "wall_s": wall,
        "productive_s": parts["productive"],
        "fraction": parts["productive"] / wall if wall > 0 else None,
        **{f"{k}_s": parts[k] for k in ("init", "checkpoint", "eval", "lost", "restart")},
        "other_s": max(wall - sum(parts.values()), 0.0),
    }


def _attempts(procs: Sequence[ProcessState]) -> dict[str, list[list[ProcessState]]]:
    """Per source, its attempts in order, each a list of processes."""
    by: dict[str, dict[int, list[ProcessState]]] = {}
    for d in procs:
        by.setdefault(d.source, {}).setdefault(d.attempt, []).append(d)
    return {src: [att[a] for a in sorted(att)] for src, att in by.items()}


def _attempt_layers(attempts: list[list[ProcessState]], layers: dict[str, list[Intervals]]) -> None:
    """Restart gaps, init, lost and productive steps of one source's attempts."""
    redone: set[int] = set()  # steps that some later attempt ran
    for i in range(len(attempts) - 1, -1, -1):
        procs = attempts[i]
        begin = min(d.first_ts for d in procs)  # type: ignore[type-var]
        end = max(d.last_ts for d in procs)  # type: ignore[type-var]
        if i + 1 < len(attempts):
            nxt = min(d.first_ts for d in attempts[i + 1])  # type: ignore[type-var]
            layers["restart"].append((np.array([end]), np.array([max(nxt, end)])))
        mine: set[int] = set()
        first_step = end
        for d in procs:
            steps, starts, ends, done = _steps(d)
            if starts.size:
                first_step = min(first_step, float(starts.min()))
            lost = np.isin(steps, list(redone))
            layers["lost"].append((starts[lost], ends[lost]))
            layers["productive"].append((starts[done & ~lost], ends[done & ~lost]))
            mine.update(steps.tolist())
        layers["init"].append((np.array([begin]), np.array([first_step])))
        redone |= mine


def _steps(d: ProcessState) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step spans of one process: step numbers, start and end times, and whether each completed
    (closed without error). A step still open at the end lasts until the process's last record."""
    steps, durs, ends = columns(d, STEP)
    failed = {e.step for e in d.errors if e.name == STEP}
    done = ~np.isin(steps, list(failed)) if failed else np.ones(steps.size, bool)
    unclosed = [u for u in d.unclosed if u.name == STEP and u.step is not None]
    steps = np.concatenate([steps, [u.step for u in unclosed]]).astype(np.int64)
    starts = np.concatenate([ends - durs / 1000.0, [u.start_ts for u in unclosed]])
    ends = np.concatenate([ends, [d.last_ts] * len(unclosed)])
    done = np.concatenate([done, np.zeros(len(unclosed), bool)])
    keep = steps != NO_STEP
    return steps[keep], starts[keep], ends[keep], done[keep]


def _closed(d: ProcessState, name: str) -> Intervals:
    _, durs, ends = columns(d, name)
    return ends - durs / 1000.0, ends


def _concat(parts: list[Intervals]) -> Intervals:
    if not parts:
        return np.empty(0), np.empty(0)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Disjoint sorted intervals covering the same time as the given ones."""
    ok = ends > starts
    starts, ends = starts[ok], ends[ok]
    if not starts.size:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    new = np.concatenate([[True], starts[1:] > ends[:-1]])
    last = np.concatenate([np.flatnonzero(new)[1:] - 1, [starts.size - 1]])
    return starts[new], ends[last]


def _measure(layers: list[Intervals], t0: float, t1: float) -> list[float]:
    """Seconds of [t0, t1] each layer covers that no earlier layer covers."""
    merged = [_union(np.clip(s, t0, t1), np.clip(e, t0, t1)) for s, e in layers]
    bounds = np.unique(np.concatenate([[t0, t1], *(np.concatenate(m) for m in merged)]))
    mid, length = (bounds[:-1] + bounds[1:]) / 2.0, np.diff(bounds)
    taken = np.zeros(mid.size, bool)
    out = []
    for starts, ends in merged:
        i = np.searchsorted(starts, mid, side="right") - 1
        covered = (i >= 0) & (mid < ends[np.maximum(i, 0)]) if starts.size else np.zeros(mid.size, bool)
        out.append(float(length[covered & ~taken].sum()))
        taken |= covered
    return out
