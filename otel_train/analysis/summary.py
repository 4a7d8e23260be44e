"""The ``summarize`` answer: where each process stopped, phase timings, and the findings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from otel_train import schema
from otel_train.analysis.comm import CommOp, Group
from otel_train.analysis.findings import findings
from otel_train.analysis.goodput import goodput
from otel_train.analysis.profile_windows import with_profiles
from otel_train.analysis.records import Warn, logs_dir, warn_to_stderr
from otel_train.analysis.reading.cache import uses
from otel_train.analysis.spans import NO_STEP, ProcessState, Run, load_run
from otel_train.phases import STEP
from otel_train.analysis.stats import durations, quantiles


FR_DIR = "flight_recorder"
"""Where a run's Flight Recorder dumps are by default (the ``fr_dir`` setting's default)."""


def summarize(path: str | Path, *, fr: str | Path | None = None, **load_kwargs: Any) -> dict[str, Any]:
    """Summary of the run at ``path`` (see ``summarize_run``) with the Flight Recorder dumps under ``fr``
    (default: :func:`default_fr`) merged; raises TraceReadError without trace files."""
    run = load_run(path, **load_kwargs)
    with_dumps(run, fr if fr is not None else default_fr(path, run), load_kwargs.get("warn"))
    return with_profiles(summarize_run(run), path)


def default_fr(path: str | Path, run: Run | None = None) -> Path:
    """The run's dump directory: the ``fr_dir`` its processes recorded (``process_start`` settings),
    else ``<run>/flight_recorder``."""
    for d in run.processes if run is not None else ():
        given = d.settings.get("fr_dir")
        if isinstance(given, str) and given:
            return Path(given)
    logs = logs_dir(path)
    return (logs.parent if logs.name == schema.STRUCTURED_LOGS_DIR else logs) / FR_DIR


def read_fr(path: str | Path, warn: Warn | None = None, run: Run | None = None) -> tuple[list[CommOp], list[Group]]:
    """The comm ops and groups of the Flight Recorder dumps under ``path`` (docs/comm.md); none when
    it does not exist. A dump that cannot be read, and ranks without a dump, are one line each to ``warn``."""
    path = Path(path)
    uses(path)  # a remembered result depends on the dumps, there or not (reading/cache.py)
    if not path.exists():
        return [], []
    from otel_train.analysis.flight_recorder import read_dumps  # here: most runs have no dumps to read

    states = run.processes if run is not None else []
    known = [g for d in states for g in d.comm_groups.values()]
    world = max((d.world_size or 0 for d in states), default=0) or None
    try:
        dumps = read_dumps(path, warn=warn or warn_to_stderr, world_size=world, groups=known)
    except Exception as exc:  # noqa: BLE001 - a broken dump must not cost the summary of the trace
        (warn or warn_to_stderr)(f"warning: {path}: Flight Recorder dumps not read ({type(exc).__name__}: {exc})")
        return [], []
    return with_steps(dumps.ops, states), list(dumps.groups.values())


def with_steps(ops: Sequence[CommOp], states: Sequence[ProcessState]) -> list[CommOp]:
    """Dump ops with the step they were issued in, where the dump has none: the step whose ``step`` span
    (closed or still open) on that process holds the op's creation time; the same process's clock, so
    no alignment is needed. Ops of a rank without trace files keep no step."""
    spans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for d in states:
        series = d.phases.get(STEP)
        starts, ends, steps = ([], [], []) if series is None else (
            list(np.frombuffer(series.ends) - np.frombuffer(series.durs) / 1000.0), list(series.ends),
            list(series.steps))
        for u in d.unclosed:
            if u.name == STEP and u.step is not None:
                starts.append(u.start_ts), ends.append(math.inf), steps.append(u.step)
        order = np.argsort(starts)
        spans[(d.rank, d.attempt)] = (np.asarray(starts)[order], np.asarray(ends)[order], np.asarray(steps)[order])
    out = []
    for op in ops:
        found = spans.get((op.rank, op.attempt))
        if op.step is None and op.start is not None and found is not None and found[0].size:
            i = int(np.searchsorted(found[0], op.start, side="right")) - 1
            if i >= 0 and op.start <= found[1][i]:
                op = dataclasses.replace(op, step=int(found[2][i]))
        out.append(op)
    return out


def with_dumps(run: Run, fr: str | Path | None, warn: Warn | None = None) -> Run:
    """``run`` with the dumps under ``fr`` (when given and present) as its extra comm ops and groups."""
    if fr is not None:
        ops, groups = read_fr(fr, warn, run)
        if ops or groups:
            run.extra_ops, run.extra_groups, run.graphs = ops, groups, None
    return run


def summarize_run(run: Run) -> dict[str, Any]:
    """The ``summarize --json`` object (docs/analysis.md): processes, unclosed, phases, findings, clock,
    goodput, malformed_lines."""
    order = run.phase_order()
    found = findings(run)
    return {
        "processes": [process_row(d) for d in run.processes],
        "unclosed": [row for d in run.processes for row in unclosed_rows(d)],
        "phases": _phase_rows(run, order),
        "findings": found,
        "clock": clock_rows(run),
        "goodput": goodput(run),
        "malformed_lines": run.malformed_lines,
    }


def clock_rows(run: Run) -> list[dict[str, Any]]:
    """``summarize --json``'s ``clock`` (docs/clock.md): each host's offset, drift, residual and samples
    against the reference host; empty for one host, no collective, or ``run.align`` off."""
    clock = next((g.clock for g in run.comm.values() if g.clock is not None), None)
    return clock.rows() if clock is not None else []


def process_row(d: ProcessState) -> dict[str, Any]:
    """One ``processes`` row of the summary."""
    return {
        "rank": d.rank,
        "attempt": d.attempt,
        "source": d.source,
        "format": d.format,  # whose files: otel-train, torchtitan or pimm (docs/integrations-frameworks.md)
        "host": d.host,
        "pid": d.pid,
        "world_size": d.world_size,
        "final_step": d.final_step,
        "relative_step": d.relative_step,
        "last_event": d.last_event,
        "last_ts": d.last_ts,
        "open_spans": [u.name for u in d.unclosed],
        "ended_cleanly": d.ended_cleanly,
        "signal": d.end_signal,  # "SIGTERM": shut down on a signal; null: ended by itself, or died
        "records": d.records,
    }


def unclosed_rows(d: ProcessState) -> list[dict[str, Any]]:
    """The ``unclosed`` rows of one process."""
    last_phase = d.last_phase()
    return [
        {
            "rank": d.rank,
            "attempt": d.attempt,
            "source": d.source,
            "name": u.name,
            "step": u.step,
            "span_id": u.span_id,
            "start_ts": u.start_ts,
            "status": u.status,
            "last_phase": last_phase,
        }
        for u in d.unclosed
    ]


def _phase_rows(run: Run, order: list[str]) -> list[dict[str, Any]]:
    names = [n for n in order if any(n in d.phases for d in run.processes)]
    rows = []
    for name in names:
        columns: list[np.ndarray] = []
        slowest: tuple[float, ProcessState, int] | None = None
        for d in run.processes:
            steps, durs = durations(d, name)
            if not durs.size:
                continue
            columns.append(durs)
            top = int(durs.argmax())
            if slowest is None or durs[top] > slowest[0]:
                slowest = (float(durs[top]), d, int(steps[top]))
        if slowest is None:
            continue
        values = np.concatenate(columns)
        p50, p95 = quantiles(values, (0.5, 0.95))
        dur, who, step = slowest
        rows.append(
            {
                "name": name,
                "count": int(values.size),
                "mean_ms": float(values.mean()),
                "p50_ms": p50,
                "p95_ms": p95,
                "max_ms": dur,
                "slowest": {
                    "rank": who.rank,
                    "attempt": who.attempt,
                    "step": step if step != NO_STEP else None,
                    "dur_ms": dur,
                },
            }
        )
    return rows
