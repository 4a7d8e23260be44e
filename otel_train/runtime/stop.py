"""``shutdown``: end still-open spans as incomplete, flush the exporters, close the trace file with
``process_end``, and say once what went wrong. Bounded by its deadline; nothing raises out of it."""

from __future__ import annotations

import os
import time
from typing import Any

from otel_train import _report, api
from otel_train import context as step_context
from otel_train import schema as S
from otel_train.exporters.jsonl.processor import JsonlSpanProcessor
from otel_train.exporters.jsonl.writer import RotatingFileWriter
from otel_train.exporters.otlp import shutdown_processors
import otel_train.runtime.state as state

SIGTERM_SHUTDOWN_TIMEOUT_S = 3.0
SHUTDOWN_FILE_FLOOR_S = 1.0  # what shutdown leaves the trace file's last records after the exporters, at least


def shutdown(timeout_s: float = 5.0) -> None:
    """End still-open spans as incomplete, flush and close everything; returns within ``timeout_s`` (or
    ``SHUTDOWN_FILE_FLOOR_S`` after the exporters, when they took it all: the trace file's last records)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    rt = state.active
    if rt is None or rt.pid != os.getpid():
        # A fork child between fork and its after-fork hook (a SIGTERM from Pool.terminate lands
        # there) still sees its parent's runtime: it must neither end the parent's spans in the
        # parent's file nor touch locks or threads it inherited mid-use.
        return
    with state.lock:
        rt = state.active
        if rt is None:
            return
        state.active = None
        api._tracing = None  # new calls are no-ops from here on; in-flight spans are ended below
        for undo in reversed(rt.undo):
            quietly(undo)
        jsonl = rt.jsonl
        if jsonl is not None:
            jsonl.finish_by(max(deadline, time.monotonic() + SHUTDOWN_FILE_FLOOR_S))  # a stalled write: bounded
        incomplete = jsonl.end_open_spans() if jsonl is not None else 0
        quietly(shutdown_processors, rt.batch_processors, max(0.0, deadline - time.monotonic()))
        dropped = sum(processor.dropped for processor in rt.batch_processors)
        for processor in rt.other_processors:
            quietly(processor.shutdown)
        if dropped:
            _report.report("spans dropped", f"{dropped} span(s) could not be exported (collector unreachable or "
                           "queue full); the JSONL file has them all")
        if jsonl is not None:
            # Every wait for the write lock from here on (a stalled write holds it) is bounded by the
            # deadline (the exporters may have spent it: the file's last records get FILE_FLOOR_S still).
            jsonl.finish_by(max(deadline, time.monotonic() + SHUTDOWN_FILE_FLOOR_S))
            if rt.watchdog is not None:
                quietly(rt.watchdog.final_digest)
            _finish_file(jsonl, rt.writer, incomplete, dropped)
        _report_at_shutdown(jsonl.dropped_records if jsonl is not None else 0,
                            jsonl.records_written if jsonl is not None else 0)
        for handler in rt.record_handlers:
            if callable(getattr(handler, "shutdown", None)):
                quietly(handler.shutdown)
        step_context.reset()  # a later init() is a new session: relative steps count afresh


def _finish_file(jsonl: JsonlSpanProcessor, writer: RotatingFileWriter | None, incomplete: int, dropped: int) -> None:
    if dropped:
        jsonl.instant(S.INSTANT_SPANS_DROPPED, {"count": dropped})
    if writer is not None and (writer.errors or writer.lost_records):
        jsonl.instant(S.INSTANT_WRITE_ERRORS, {"count": writer.errors, "dropped_bytes": writer.dropped_bytes,
                                               "lost_records": writer.lost_records, "lost_bytes": writer.lost_bytes})
    jsonl.finish(S.INSTANT_PROCESS_END, lambda seq, dropped_records: {
        "records": seq,
        "incomplete_spans": incomplete,
        "spans_dropped": dropped,
        "write_errors": writer.errors if writer is not None else 0,
        "dropped_records": dropped_records,
        **_comm_lost(),
        **({"signal": state.end_signal} if state.end_signal else {}),
    })


def _comm_lost() -> dict[str, int]:
    """``comm_ops_lost``: comm ops without a span (the Flight Recorder buffer wrapped; docs/comm.md, "Cost")."""
    lost = _report.counts().get("comm.flight_recorder_lost", 0)
    return {"comm_ops_lost": lost} if lost else {}


def _report_at_shutdown(dropped_records: int, made: int) -> None:
    # Each fault printed one line when it first happened; one more line says what it all added up to
    # (process_end may not have reached the file: a stalled writer, docs/runtime.md).
    parts = []
    if dropped_records:
        parts.append(f"{dropped_records} record(s) of this process are not in its trace file "
                     f"(process_end.dropped_records; {made} made)")
    repeated = {key: n for key, n in _report.counts().items() if n > 1}
    if repeated:
        parts.append("faults seen more than once: " + ", ".join(f"{key} ×{n}" for key, n in sorted(repeated.items())))
    if parts:
        _report.logger.warning("otel-train: at shutdown: %s", "; ".join(parts))


def quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # shutdown must finish whatever one part does
        _report.report_exception(f"shutdown step {getattr(fn, '__qualname__', fn)!r}", exc)
