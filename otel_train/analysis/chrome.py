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
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import msgspec

from otel_train import schema
from otel_train._version import __version__
from otel_train.analysis.model import ProcessTrace, Span, iter_process_traces
from otel_train.analysis.reader import Reader, find_process_files, logs_dir
from otel_train.analysis.tracks import ExportResult, ProcessLayout, is_incomplete, layout_process

FORMATS = ("chrome", "perfetto")
ANALYSIS_DIR = "analysis"
DEFAULT_NAMES = {"chrome": "structured_trace.json", "perfetto": "structured_trace.pftrace",
                 "otlp-json": "structured_trace.otlp.json"}
TID_STRIDE = 100_000
"""Track k of process pid gets tid ``pid * TID_STRIDE + k + 1``: unique across the whole trace."""
ERROR_CNAME = "terrible"
_HEAD_RECORDS = 64

_encode = msgspec.json.Encoder().encode


class _Head(msgspec.Struct):
    ts: float
    kind: str = ""
    dur_ms: float | None = None


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
) -> ExportResult:
    """Write the run at ``path`` as ``fmt`` (``chrome`` JSON or ``perfetto`` protobuf) to ``output``.

    Raises TraceReadError when ``path`` holds no trace files, ValueError for an unknown format. The
    file is written next to ``output`` and renamed into place, so a failed export leaves no torn file.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(FORMATS)}")
    reader = reader if reader is not None else Reader()
    out = Path(output) if output is not None else default_output(path, fmt)
    origin = trace_origin(path, ranks)
    traces = iter_process_traces(path, reader, ranks=ranks, steps=steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if fmt == "chrome":
            with tmp.open("w", encoding="utf-8", buffering=1 << 20) as f:
                counts = write_chrome(traces, f, origin=origin, reader=reader)
        else:
            from otel_train.analysis.perfetto import write_perfetto

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
    quiet = Reader(warn=lambda _msg: None)
    best = math.inf
    for pf in find_process_files(path):
        if ranks is not None and pf.rank not in ranks:
            continue
        for i, head in enumerate(quiet.typed(pf, _Head)):
            ts = head.ts
            if head.kind == schema.SPAN_END and head.dur_ms is not None:
                ts -= head.dur_ms / 1000.0
            best = min(best, ts)
            if i >= _HEAD_RECORDS:
                break
    return 0.0 if best == math.inf else best


def write_chrome(
    traces: Iterable[ProcessTrace], f: IO[str], *, origin: float, reader: Reader | None = None
) -> tuple[int, int, int, int]:
    """Stream ``traces`` as one Chrome trace JSON object; returns (slices, instants, counters, processes)."""
    origin_us = int(origin * 1e6)
    f.write('{"displayTimeUnit":"ms","traceEvents":[\n')
    slices = instants = counters = processes = 0
    first = True
    for index, trace in enumerate(traces):
        lay = layout_process(trace, index)
        events: list[str] = []
        _metadata(lay, events)
        slices += _slices(lay, origin_us, events)
        instants += _instants(lay, origin_us, events)
        counters += _counters(lay, origin_us, events)
        if not first:
            f.write(",\n")
        f.write(",\n".join(events))
        first = False
        processes += 1
    other = {
        "generator": f"otel-train {__version__}",
        "trace_start_unix_us": origin_us,
        "trace_start_utc": datetime.fromtimestamp(origin_us / 1e6, timezone.utc).isoformat(),
        "time_unit": "us since trace_start_unix_us",
        "processes": processes,
        "malformed_lines": reader.malformed_lines if reader is not None else 0,
    }
    f.write('\n],"otherData":')
    f.write(_encode(other).decode())
    f.write("}\n")
    return slices, instants, counters, processes


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
    names: dict[str, str] = {}
    append = events.append
    for span, end, track in zip(lay.trace.spans, lay.ends, lay.span_tracks):
        nm = names.get(span.name)
        if nm is None:
            nm = names[span.name] = _encode(span.name).decode()
        ts = int(span.start_ts * 1e6 + 0.5) - origin_us
        dur = int(end * 1e6 + 0.5) - origin_us - ts
        args = _span_args(span, is_incomplete(span))
        cname = f',"cname":"{ERROR_CNAME}"' if span.error is not None or span.status == schema.STATUS_ERROR else ""
        append(
            f'{{"ph":"X","name":{nm},"cat":"span","ts":{ts},"dur":{dur},"pid":{pid},'
            f'"tid":{base_tid + track},"args":{args}{cname}}}'
        )
    return len(lay.trace.spans)


def _span_args(span: Span, incomplete: bool) -> str:
    """``{"step":…,"span_id":…,"status":…, attrs…, "error":…, "incomplete":true}``."""
    head = f'"span_id":"{span.span_id}","status":"{span.status}"'
    if span.step is not None:
        head = f'"step":{int(span.step)},{head}'
    if span.attrs:
        head += "," + _encode(span.attrs).decode()[1:-1]
    if span.error is not None:
        head += ',"error":' + _encode(span.error).decode()
    if incomplete:
        head += ',"incomplete":true'
    return "{" + head + "}"


def _instants(lay: ProcessLayout, origin_us: int, events: list[str]) -> int:
    pid = lay.pid
    base_tid = pid * TID_STRIDE + 1
    for rec, track in zip(lay.trace.instants, lay.instant_tracks):
        ts = int(float(rec[schema.TS]) * 1e6 + 0.5) - origin_us
        args: dict = {}
        if rec.get(schema.STEP) is not None:
            args[schema.STEP] = rec[schema.STEP]
        attrs = rec.get(schema.ATTRS)
        if isinstance(attrs, dict):
            args.update(attrs)
        name = _encode(str(rec.get(schema.NAME, ""))).decode()
        events.append(
            f'{{"ph":"i","s":"t","name":{name},"cat":"instant","ts":{ts},"pid":{pid},'
            f'"tid":{base_tid + track},"args":{_encode(args).decode()}}}'
        )
    return len(lay.instant_tracks)


def scalar_values(rec: dict) -> list[tuple[str, float | int]]:
    """The numeric, finite values of a scalar record (bools as 0/1); anything else is skipped."""
    values = rec.get(schema.VALUES)
    if not isinstance(values, dict):
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
        ts = int(float(rec[schema.TS]) * 1e6 + 0.5) - origin_us
        for key, value in scalar_values(rec):
            nm = names.get(key)
            if nm is None:
                nm = names[key] = _encode(key).decode()
            events.append(f'{{"ph":"C","name":{nm},"ts":{ts},"pid":{pid},"args":{{"value":{value!r}}}}}')
            n += 1
    return n
