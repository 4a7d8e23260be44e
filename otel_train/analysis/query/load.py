"""Read a run for the query views: the one span model, each process once (docs/query.md, "Views").

Each process is read by :func:`~otel_train.analysis.spans.read_process` with ``keep=True`` (its spans,
instants and scalars), turned into columns (:func:`.columns.take_columns`) and made compact; the
compact states make the :class:`~otel_train.analysis.spans.Run` that summarize, whatif and the comm
graphs use. Large runs are read by a process pool, as :func:`~otel_train.analysis.spans.load_run`
reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.analysis.pools import pool_context
from otel_train.analysis.query.columns import take_columns
from otel_train.analysis.records import Head, ProcessFiles, Reader, Warn
from otel_train.analysis.spans import PARALLEL_MIN_BYTES, ProcessState, Run, clock_domains, process_order, read_process

Task = tuple[ProcessFiles, int, "Head | None", "tuple[int, int] | None"]


@dataclass(slots=True)
class Loaded:
    """A run read for the views: the run (compact states, sorted) and each state's columns, same order."""

    run: Run
    columns: list[dict[str, dict[str, Any]]]


def _read_one(task: Task) -> tuple[ProcessState, dict[str, dict[str, Any]], list[str]]:
    pf, attempt, meta, steps = task
    warnings: list[str] = []
    state = read_process(pf, attempt, Reader(warn=warnings.append), keep=True, steps=steps, meta=meta)
    cols = take_columns(state)
    state._sinks = state._comm_sinks = {}  # bound appenders: made again on demand, not worth pickling
    return state, cols, warnings


def load_for_views(path: str | Path, *, warn: Warn | None = None, steps: tuple[int, int] | None = None,
                   workers: int | None = None) -> Loaded:
    """Every process of the run at ``path`` (only steps ``steps``, inclusive, when given); raises
    TraceReadError when it holds no trace files."""
    reader = Reader(warn=warn)
    order = process_order(path, warn=reader.bad.warn)
    tasks: list[Task] = [(pf, attempt, meta, steps) for pf, attempt, meta in order]
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    big = sum(pf.size for pf, _, _ in order) >= PARALLEL_MIN_BYTES and steps is None
    if workers > 1 and big:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
            read = list(pool.map(_read_one, tasks))
    else:
        read = [_read_one(t) for t in tasks]
    kept = []
    for (pf, _, _, _), (state, cols, warnings) in zip(tasks, read):
        reader.absorb(state.malformed, warnings, pf.size)
        if state.records:
            kept.append((state, cols))
    kept.sort(key=lambda sc: (sc[0].rank, sc[0].attempt, sc[0].source))
    states = [s for s, _ in kept]
    clock_domains(states)
    return Loaded(Run(states, reader.malformed_lines), [c for _, c in kept])
