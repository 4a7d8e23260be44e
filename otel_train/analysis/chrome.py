"""Export a run as a Chrome trace (JSON) or a Perfetto trace (protobuf), streaming one process at a time.

Chrome trace layout: one process per (rank, attempt) with a synthetic pid (real pids collide across
hosts), named ``rank 3`` / ``rank 3 (attempt 1)``, labelled with host and real pid, sorted by rank;
one thread per track (see ``tracks``); spans as complete events (``X``), instants as thread-scoped
instant events (``i``), scalars as counters (``C``). Timestamps are whole microseconds since the
trace start, whose Unix time is kept in ``otherData.trace_start_unix_us``; whole microseconds make
rounding monotonic, so nesting survives it exactly.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import msgspec

from otel_train import schema
from otel_train._version import __version__
from otel_train.analysis.records import ProcessFiles, Reader, Scalar, SpanEnd, find_process_files, logs_dir, peek
from otel_train.analysis.spans import PARALLEL_MIN_BYTES, ProcessState, iter_processes, pool_context, process_order, read_process
from otel_train.analysis.tracks import ExportResult, ProcessLayout, layout_process

FORMATS = ("chrome", "perfetto")
ANALYSIS_DIR = "analysis"
DEFAULT_NAMES = {"chrome": "structured_trace.json", "perfetto": "structured_trace.pftrace",
                 "otlp-json": "structured_trace.otlp.json"}
TID_STRIDE = 100_000
"""Track k of process pid gets tid ``pid * TID_STRIDE + k + 1``: unique across the whole trace."""
ERROR_CNAME = "terrible"
_HEAD_RECORDS = 64

_encode = msgspec.json.Encoder().encode


def default_output(path: str | Path, fmt: str = "chrome") -> Path:
    """``<run>/analysis/structured_trace.json`` (``.pftrace`` for perfetto) for a run or logs dir."""
    logs = logs_dir(path)
    run = logs.parent if logs.name == schema.STRUCTURED_LOGS_DIR else logs
    return run / ANALYSIS_DIR / DEFAULT_NAMES[fmt]


def export_trace(
    path: str | Path,
    output: str | Path | None = None,
    *,
    fmt: str = "chrome",
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
    reader: Reader | None = None,
    workers: int | None = None,
) -> ExportResult:
    """Write the run at ``path`` as ``fmt`` (``chrome`` JSON or ``perfetto`` protobuf) to ``output``.

    Raises TraceReadError when ``path`` holds no trace files, ValueError for an unknown format. The
    file is written next to ``output`` and renamed into place, so a failed export leaves no torn file.
    ``workers`` (default: CPU count) > 1 renders the processes of a large run in parallel (Chrome JSON).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(FORMATS)}")
    reader = reader if reader is not None else Reader()
    out = Path(output) if output is not None else default_output(path, fmt)
    origin = trace_origin(path, ranks)
    order = process_order(path, ranks)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if fmt == "chrome":
            with tmp.open("wb", buffering=1 << 20) as fb:
                counts = _write_chrome_run(order, fb, origin, reader, steps, workers)
        else:
            from otel_train.analysis.perfetto import write_perfetto

            traces = iter_processes(path, reader, ranks=ranks, steps=steps)
            with tmp.open("wb", buffering=1 << 20) as fb:
                counts = write_perfetto(traces, fb)
        os.replace(tmp, out)
    except OSError as exc:
        if exc.filename == str(tmp):  # name the file the user asked for, not our temporary
            raise OSError(exc.errno, exc.strerror, str(out)) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    slices, instants, counters, processes = counts
    return ExportResult(slices, instants, counters, processes, out, reader.malformed_lines)


def trace_origin(path: str | Path, ranks: set[int] | None = None) -> float:
    """Earliest Unix time in the run, from the head of each process's oldest segment.

    A span whose start record rotated away starts ``dur_ms`` before its end record, so the first
    records' durations are taken into account.
    """
    best = math.inf
    for pf in find_process_files(path, warn=lambda _msg: None):
        if ranks is not None and pf.rank not in ranks:
            continue
        for rec in peek(pf):
            ts = rec.ts
            if type(rec) is SpanEnd and rec.dur_ms is not None:
                ts -= rec.dur_ms / 1000.0
            best = min(best, ts)
    return 0.0 if best == math.inf else best


_HEAD = b'{"displayTimeUnit":"ms","traceEvents":[\n'
_SEP = b",\n"


def write_chrome(
    traces: Iterable[ProcessState], f: IO[bytes], *, origin: float, reader: Reader | None = None
) -> tuple[int, int, int, int]:
    """Stream ``traces`` as one Chrome trace JSON object (UTF-8) to the binary file ``f``.

    Returns (slices, instants, counters, processes).
    """
    origin_us = int(origin * 1e6)
    f.write(_HEAD)
    totals = [0, 0, 0, 0]
    for index, trace in enumerate(traces):
        text, counts = render_process(trace, index, origin_us)
        if index:
            f.write(_SEP)
        f.write(text.encode())
        totals = [a + b for a, b in zip(totals, counts)]
    _write_tail(f, origin_us, totals[3], reader.malformed_lines if reader is not None else 0)
    return totals[0], totals[1], totals[2], totals[3]


def _write_tail(f: IO[bytes], origin_us: int, processes: int, malformed: int) -> None:
    other = {
        "generator": f"otel-train {__version__}",
        "trace_start_unix_us": origin_us,
        "trace_start_utc": datetime.fromtimestamp(origin_us / 1e6, timezone.utc).isoformat(),
        "time_unit": "us since trace_start_unix_us",
        "processes": processes,
        "malformed_lines": malformed,
    }
    f.write(b'\n],"otherData":' + _encode(other) + b"}\n")


def render_process(trace: ProcessState, index: int, origin_us: int) -> tuple[str, tuple[int, int, int, int]]:
    """One process's events as Chrome JSON text (comma separated) and its counts
    (slices, instants, counters, 1); ``index`` is its place in the export (synthetic pid ``index + 1``)."""
    lay = layout_process(trace, index)
    events: list[str] = []
    _metadata(lay, events)
    slices = _slices(lay, origin_us, events)
    instants = _instants(lay, origin_us, events)
    counters = _counters(lay, origin_us, events)
    return ",\n".join(events), (slices, instants, counters, 1)


def _write_chrome_run(
    order: list[tuple[ProcessFiles, int]],
    f: IO[bytes],
    origin: float,
    reader: Reader,
    steps: tuple[int, int] | None,
    workers: int | None,
) -> tuple[int, int, int, int]:
    """The whole run as Chrome JSON, process ``i`` of ``order`` with pid ``i + 1``: rendered here, or
    for a large run by a pool of workers into part files that are appended here in order."""
    origin_us = int(origin * 1e6)
    sizes = [pf.size for pf, _, _ in order]
    workers = min(workers or os.cpu_count() or 1, len(order))
    f.write(_HEAD)
    totals = [0, 0, 0, 0]

    def append(counts: tuple[int, int, int, int], data: bytes | None, part: str | None) -> None:
        nonlocal totals
        if data is None and part is None:
            return  # a process without a single valid record
        if totals[3]:
            f.write(_SEP)
        if part is None:
            f.write(data)  # type: ignore[arg-type]
        else:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
            os.unlink(part)
        totals = [a + b for a, b in zip(totals, counts)]

    if workers < 2 or sum(sizes) < PARALLEL_MIN_BYTES:
        for index, (pf, attempt, meta) in enumerate(order):
            trace = read_process(pf, attempt, reader, keep=True, steps=steps, meta=meta)
            if trace.records:
                text, counts = render_process(trace, index, origin_us)
                append(counts, text.encode(), None)
    else:
        stem = str(Path(f.name).with_suffix(".part"))  # type: ignore[attr-defined]
        tasks = [(pf, attempt, index, origin_us, steps, f"{stem}{index}") for index, (pf, attempt, _) in enumerate(order)]
        try:
            with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
                for size, (counts, malformed, warnings, part) in zip(sizes, pool.map(_render_task, tasks)):
                    reader.absorb(malformed, warnings, size)
                    append(counts, None, part)
        finally:
            for task in tasks:
                Path(task[-1]).unlink(missing_ok=True)
    _write_tail(f, origin_us, totals[3], reader.malformed_lines)
    return totals[0], totals[1], totals[2], totals[3]


def _render_task(
    task: tuple[ProcessFiles, int, int, int, tuple[int, int] | None, str],
) -> tuple[tuple[int, int, int, int], int, list[str], str | None]:
    """Worker: build, lay out and render one process into a part file; (counts, malformed, warnings, part)."""
    pf, attempt, index, origin_us, steps, part = task
    warnings: list[str] = []
    reader = Reader(warn=warnings.append)
    trace = read_process(pf, attempt, reader, keep=True, steps=steps)
    if not trace.records:
        return (0, 0, 0, 0), reader.malformed_lines, warnings, None
    text, counts = render_process(trace, index, origin_us)
    with open(part, "wb") as out:
        out.write(text.encode())
    return counts, reader.malformed_lines, warnings, part


def track_tid(lay: ProcessLayout, track_index: int) -> int:
    """The Chrome tid of a process's track."""
    return lay.pid * TID_STRIDE + track_index + 1


def _meta(name: str, pid: int, tid: int, args: dict) -> str:
    return f'{{"ph":"M","name":"{name}","pid":{pid},"tid":{tid},"args":{_encode(args).decode()}}}'


def _metadata(lay: ProcessLayout, events: list[str]) -> None:
    pid = lay.pid
    events.append(_meta("process_name", pid, 0, {"name": lay.name}))
    events.append(_meta("process_sort_index", pid, 0, {"sort_index": lay.index}))
    if lay.labels:
        events.append(_meta("process_labels", pid, 0, {"labels": lay.labels}))
    for track in lay.tracks:
        tid = track_tid(lay, track.index)
        events.append(_meta("thread_name", pid, tid, {"name": track.name}))
        events.append(_meta("thread_sort_index", pid, tid, {"sort_index": track.index}))


def _slices(lay: ProcessLayout, origin_us: int, events: list[str]) -> int:
    pid = lay.pid
    base_tid = pid * TID_STRIDE + 1
    heads: dict[str, str] = {}
    append = events.append
    incomplete, error = schema.STATUS_INCOMPLETE, schema.STATUS_ERROR
    # The hot loop: one f-string per slice, the constant head of each name encoded once.
    for span, end, track in zip(lay.trace.spans, lay.ends, lay.span_tracks):
        name = span.name
        head = heads.get(name)
        if head is None:
            head = heads[name] = f'{{"ph":"X","name":{_encode(name).decode()},"cat":"span","ts":'
        ts = int(span.start_ts * 1e6 + 0.5) - origin_us
        dur = int(end * 1e6 + 0.5) - origin_us - ts
        step, status, attrs, err = span.step, span.status, span.attrs, span.error
        args = f'"span_id":"{span.span_id}","status":"{status}"'
        if step is not None:
            args = f'"step":{int(step)},{args}'
        if attrs:
            args += "," + _encode(attrs).decode()[1:-1]
        if err is not None:
            args += ',"error":' + _encode(err).decode()
        if span.end_ts is None or status == incomplete:
            args += ',"incomplete":true'
        cname = f',"cname":"{ERROR_CNAME}"' if err is not None or status == error else ""
        append(f'{head}{ts},"dur":{dur},"pid":{pid},"tid":{base_tid + track},"args":{{{args}}}{cname}}}')
    return len(lay.trace.spans)


def _instants(lay: ProcessLayout, origin_us: int, events: list[str]) -> int:
    pid = lay.pid
    base_tid = pid * TID_STRIDE + 1
    for rec, track in zip(lay.trace.instants, lay.instant_tracks):
        ts = int(rec.ts * 1e6 + 0.5) - origin_us
        args: dict = {}
        if rec.step is not None:
            args[schema.STEP] = rec.step
        if rec.attrs:
            args.update(rec.attrs)
        name = _encode(rec.name).decode()
        events.append(
            f'{{"ph":"i","s":"t","name":{name},"cat":"instant","ts":{ts},"pid":{pid},'
            f'"tid":{base_tid + track},"args":{_encode(args).decode()}}}'
        )
    return len(lay.instant_tracks)


def scalar_values(rec: Scalar) -> list[tuple[str, float | int]]:
    """The numeric, finite values of a scalar record (bools as 0/1); anything else is skipped."""
    values = rec.values
    if not values:
        return []
    out = []
    for key, value in values.items():
        if type(value) is bool:
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append((str(key), value))
    return out


def _counters(lay: ProcessLayout, origin_us: int, events: list[str]) -> int:
    pid = lay.pid
    n = 0
    names: dict[str, str] = {}
    for rec in lay.trace.scalars:
        ts = int(rec.ts * 1e6 + 0.5) - origin_us
        for key, value in scalar_values(rec):
            nm = names.get(key)
            if nm is None:
                nm = names[key] = _encode(key).decode()
            events.append(f'{{"ph":"C","name":{nm},"ts":{ts},"pid":{pid},"args":{{"value":{value!r}}}}}')
            n += 1
    return n
