"""The ``summarize`` answer: where each process stopped, phase timings, and the findings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from otel_train.analysis.findings import findings
from otel_train.analysis.goodput import goodput
from otel_train.analysis.spans import NO_STEP, ProcessState, Run, load_run
from otel_train.analysis.stats import durations, quantiles


def summarize(path: str | Path, **load_kwargs: Any) -> dict[str, Any]:
    """Summary of the run at ``path`` (see ``summarize_run``); raises TraceReadError without trace files."""
    return summarize_run(load_run(path, **load_kwargs))


def summarize_run(run: Run) -> dict[str, Any]:
    """The ``summarize --json`` object (docs/analysis.md): processes, unclosed, phases, findings, goodput,
    malformed_lines."""
    order = run.phase_order()
    return {
        "processes": [process_row(d) for d in run.processes],
        "unclosed": [row for d in run.processes for row in unclosed_rows(d)],
        "phases": _phase_rows(run, order),
        "findings": findings(run),
        "goodput": goodput(run),
        "malformed_lines": run.malformed_lines,
    }


def process_row(d: ProcessState) -> dict[str, Any]:
    """One ``processes`` row of the summary."""
    return {
        "rank": d.rank,
        "attempt": d.attempt,
        "source": d.source,
        "host": d.host,
        "pid": d.pid,
        "world_size": d.world_size,
        "final_step": d.final_step,
        "relative_step": d.relative_step,
        "last_event": d.last_event,
        "last_ts": d.last_ts,
        "open_spans": [u.name for u in d.unclosed],
        "ended_cleanly": d.ended_cleanly,
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
