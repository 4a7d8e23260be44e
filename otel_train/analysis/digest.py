"""One compact pass per process: what summary and stats need, never all records in memory.

Records are decoded straight into a small msgspec Struct (unknown fields skipped by the decoder);
closed-span durations go to per-phase ``array`` columns (step, ms). Large runs are digested by a
process pool, one process file group per task, because decoding is CPU bound.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from otel_train import schema
from otel_train.analysis.model import STATUS_OPEN
from otel_train.analysis.reader import ProcessFiles, Reader, assign_attempts, find_process_files, warn_to_stderr
from otel_train.phases import STEP, STEP_PHASES

NO_STEP = -1
"""Step column value for a span recorded outside any step."""

PARALLEL_MIN_BYTES = 32 << 20
"""Runs at least this big are read by a process pool (below it, starting workers costs more than it saves)."""


class _Rec(msgspec.Struct, gc=False):
    # Only what the digest reads; every other field is skipped by the decoder without a Python object.
    v: int
    ts: float
    kind: str
    name: str = ""
    span_id: str | None = None
    parent_span_id: str | None = None
    dur_ms: float | None = None
    status: str | None = None
    error: Any = None
    step: int | None = None
    relative_step: int | None = None


@dataclass(slots=True)
class PhaseSeries:
    """Closed spans of one name: parallel columns of step (``NO_STEP`` when none) and duration in ms."""

    steps: array = field(default_factory=lambda: array("q"))
    durs: array = field(default_factory=lambda: array("d"))


@dataclass(slots=True)
class OpenSpan:
    """A span still running when the process stopped: status ``open`` or ``incomplete``."""

    name: str
    span_id: str
    parent_span_id: str | None
    step: int | None
    start_ts: float
    status: str


@dataclass(slots=True)
class ErrorSpan:
    """A span that ended with an exception."""

    name: str
    span_id: str
    parent_span_id: str | None
    step: int | None
    ts: float
    error_type: str
    message: str


@dataclass(slots=True)
class ProcessDigest:
    """What one process attempt wrote, condensed."""

    source: str
    rank: int
    attempt: int
    instance: str
    host: str | None = None
    pid: int | None = None
    world_size: int | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    last_event: str | None = None
    first_step: int | None = None
    final_step: int | None = None
    relative_step: int | None = None
    ended_cleanly: bool = False
    records: int = 0
    malformed: int = 0
    warnings: list[str] = field(default_factory=list)
    phases: dict[str, PhaseSeries] = field(default_factory=dict)
    parents: dict[str, str | None] = field(default_factory=dict)
    unclosed: list[OpenSpan] = field(default_factory=list)
    errors: list[ErrorSpan] = field(default_factory=list)
    last_closed: str | None = None  # last phase that closed inside the current step

    @property
    def innermost(self) -> OpenSpan | None:
        """The deepest span still running at the end, if any."""
        return self.unclosed[-1] if self.unclosed else None


@dataclass(slots=True)
class Run:
    """All process digests of a run, sorted by (rank, attempt, source)."""

    processes: list[ProcessDigest]
    malformed_lines: int

    def phase_order(self) -> list[str]:
        """Phase names in training-step order: the standard phases first, then others as first seen."""
        order = [STEP, *STEP_PHASES]
        seen = set(order)
        for d in self.processes:
            for name in d.phases.keys() | {u.name for u in d.unclosed}:
                if name not in seen:
                    seen.add(name)
                    order.append(name)
        return order


def digest_process(pf: ProcessFiles, attempt: int, progress: Callable[[int], None] | None = None) -> ProcessDigest:
    """Condense one process's files into a ``ProcessDigest`` (warnings are collected, not printed)."""
    d = ProcessDigest(source=pf.source, rank=pf.rank, attempt=attempt, instance=pf.instance)
    reader = Reader(warn=d.warnings.append, progress=progress)
    opened: dict[str | None, tuple[str, str | None, int | None, float]] = {}
    pop = opened.pop
    phases = d.phases
    parents = d.parents
    # Bound appenders of each phase's columns (a phase's series may also be made by _close_rare).
    sinks: dict[str, tuple[Callable[[Any], None], Callable[[Any], None]]] = {}
    last: _Rec | None = None
    first_step = final_step = relative_step = None
    last_closed: str | None = None
    n = 0
    # The hot loop: one pass, locals only, the common case (a span closing with status ok) inline;
    # the step context is taken from each chunk's last records instead of tracked per record.
    for items in reader.typed_batches(pf, _Rec):
        if not items:
            continue
        n += len(items)
        last = items[-1]
        for rec in items:
            kind = rec.kind
            if kind == _SPAN_END:
                started = pop(rec.span_id, None)
                name = rec.name
                dur = rec.dur_ms
                if started is None or dur is None or rec.status not in _PLAIN_END:
                    last_closed = _close_rare(d, rec, started, last_closed)
                    continue
                sink = sinks.get(name)
                if sink is None:
                    series = phases.setdefault(name, PhaseSeries())
                    sink = sinks[name] = (series.steps.append, series.durs.append)
                sstep = started[2]
                sink[0](NO_STEP if sstep is None else sstep)
                sink[1](dur)
                if name != STEP:
                    last_closed = name
            elif kind == _SPAN_START:
                name = rec.name
                opened[rec.span_id] = (name, rec.parent_span_id, rec.step, rec.ts)
                if name not in parents:
                    parent = opened.get(rec.parent_span_id)
                    parents[name] = parent[0] if parent else None
                if name == STEP:
                    last_closed = None
            elif kind == _INSTANT and rec.name == schema.INSTANT_PROCESS_END:
                d.ended_cleanly = True
        if first_step is None:
            first_step = next((r.step for r in items if r.step is not None), None)
        final_step = next((r.step for r in reversed(items) if r.step is not None), final_step)
        relative_step = next(
            (r.relative_step for r in reversed(items) if r.step is not None and r.relative_step is not None),
            relative_step,
        )
    d.records = n
    d.malformed = reader.malformed_lines
    d.first_step, d.final_step, d.relative_step, d.last_closed = first_step, final_step, relative_step, last_closed
    if last is not None:
        d.first_ts, d.last_ts = _head(pf, d), last.ts
        d.last_event = _event(last)
    d.unclosed.extend(
        OpenSpan(name, sid or "", parent, step, ts, STATUS_OPEN)
        for sid, (name, parent, step, ts) in opened.items()
    )
    d.unclosed.sort(key=lambda u: u.start_ts)
    return d


_SPAN_START, _SPAN_END, _INSTANT = schema.SPAN_START, schema.SPAN_END, schema.INSTANT
_PLAIN_END = (schema.STATUS_OK, None)


def _event(rec: _Rec) -> str:
    """The ``event`` field as the sink writes it (not decoded in the hot loop)."""
    if rec.kind == schema.SPAN_START:
        return rec.name + schema.START_SUFFIX
    if rec.kind == schema.SPAN_END:
        return rec.name + schema.END_SUFFIX
    return rec.name or rec.kind


class _Meta(msgspec.Struct):
    ts: float
    host: str | None = None
    pid: int | None = None
    world_size: int | None = None


def _head(pf: ProcessFiles, d: ProcessDigest) -> float | None:
    """Host, pid and world size from the first readable record; returns its ts."""
    decoder = msgspec.json.Decoder(_Meta)
    for path in pf.paths:
        try:
            with path.open("rb") as f:
                for line in f:
                    try:
                        meta = decoder.decode(line)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    d.host, d.pid, d.world_size = meta.host, meta.pid, meta.world_size
                    return meta.ts
        except OSError:
            continue
    return None


def _close_rare(d: ProcessDigest, rec: _Rec, started: tuple | None, last_closed: str | None) -> str | None:
    """A span end that is not a plain ok: error, incomplete, or without its start or duration."""
    name = rec.name
    sid = rec.span_id or ""
    step = started[2] if started is not None else rec.step
    status = rec.status or schema.STATUS_OK
    if status == schema.STATUS_INCOMPLETE:
        start_ts = started[3] if started is not None else rec.ts - (rec.dur_ms or 0.0) / 1000.0
        d.unclosed.append(OpenSpan(name, sid, rec.parent_span_id, step, start_ts, status))
        return last_closed
    dur = rec.dur_ms
    if dur is None:
        dur = (rec.ts - started[3]) * 1000.0 if started is not None else 0.0
    series = d.phases.get(name)
    if series is None:
        series = d.phases[name] = PhaseSeries()
    d.parents.setdefault(name, None)
    series.steps.append(NO_STEP if step is None else step)
    series.durs.append(dur)
    if status == schema.STATUS_ERROR:
        err = rec.error if isinstance(rec.error, dict) else {}
        d.errors.append(
            ErrorSpan(
                name, sid, rec.parent_span_id, step, rec.ts, str(err.get("type", "error")), str(err.get("message", ""))
            )
        )
    return name if name != STEP else last_closed


def _digest_task(args: tuple[ProcessFiles, int]) -> ProcessDigest:
    return digest_process(*args)


def load_run(
    path: str | Path,
    *,
    warn: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> Run:
    """Digest every process of the run at ``path``; raises TraceReadError when it holds no trace files.

    ``warn`` gets one line per file with malformed lines (default: stderr); ``progress`` gets byte
    counts as they are consumed. ``workers`` (default: CPU count) > 1 digests large runs in parallel.
    """
    pfs = find_process_files(path)
    attempts = assign_attempts(pfs)
    warn = warn or warn_to_stderr
    tasks = [(pf, attempts[pf]) for pf in pfs]
    sizes = {pf: pf.size for pf in pfs}
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    digests: list[ProcessDigest] = []
    if workers > 1 and sum(sizes.values()) >= PARALLEL_MIN_BYTES:
        with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
            for (pf, _), d in zip(tasks, pool.map(_digest_task, tasks)):
                if progress is not None:
                    progress(sizes[pf])
                digests.append(d)
                _emit(d.warnings, warn)
    else:
        for pf, attempt in tasks:
            d = digest_process(pf, attempt, progress)
            digests.append(d)
            _emit(d.warnings, warn)
    malformed = sum(d.malformed for d in digests)
    digests = [d for d in digests if d.records]
    digests.sort(key=lambda d: (d.rank, d.attempt, d.source))
    return Run(digests, malformed)


def _emit(lines: Iterable[str], warn: Callable[[str], None]) -> None:
    for line in lines:
        warn(line)


def pool_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for analysis pools."""
    # fork is cheapest, but forking a process that runs other threads can deadlock them.
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if os.name == "posix" else "spawn")
