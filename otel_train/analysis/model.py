"""The span model: start/end records paired into spans, one ``ProcessTrace`` per process attempt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from otel_train import schema
from otel_train.analysis.reader import ProcessFiles, Reader, assign_attempts, find_process_files

STATUS_OPEN = "open"
"""A span with a start record and no end record at all (the process died inside it)."""


@dataclass(slots=True)
class Span:
    """One span. ``end_ts`` is None while open; ``status``: ok, error, incomplete, or open."""

    name: str
    span_id: str
    parent_span_id: str | None
    trace_id: str
    start_ts: float
    end_ts: float | None
    status: str
    tid: int | None
    step: int | None
    attrs: dict = field(default_factory=dict)
    error: dict | None = None

    @property
    def dur_ms(self) -> float | None:
        """Duration in milliseconds, None while open."""
        return None if self.end_ts is None else (self.end_ts - self.start_ts) * 1000.0

    @property
    def unclosed(self) -> bool:
        """Still running when the process stopped: open, or ended as incomplete by shutdown."""
        return self.status in (STATUS_OPEN, schema.STATUS_INCOMPLETE)


@dataclass(slots=True)
class ProcessTrace:
    """Everything one process attempt wrote; ``ended_cleanly`` means a process_end instant was seen."""

    source: str
    rank: int
    attempt: int
    host: str | None
    pid: int | None
    world_size: int | None
    first_ts: float
    last_ts: float
    spans: list[Span]
    instants: list[dict]
    scalars: list[dict]
    ended_cleanly: bool


def iter_process_traces(
    path: str | Path,
    reader: Reader,
    *,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
) -> Iterator[ProcessTrace]:
    """One ``ProcessTrace`` per (source, rank, attempt), sorted by rank then attempt; one in memory at a time.

    ``steps=(lo, hi)`` (inclusive) keeps spans, instants and scalars whose step is in range; those
    without a step are kept when they overlap the time window covered by the in-range records.
    Raises TraceReadError when ``path`` holds no trace files.
    """
    pfs = [pf for pf in find_process_files(path) if ranks is None or pf.rank in ranks]
    attempts = assign_attempts(pfs)
    pfs.sort(key=lambda pf: (pf.rank, attempts[pf], pf.source))
    for pf in pfs:
        trace = build_process_trace(pf, attempts[pf], reader)
        if trace is None:
            continue
        if steps is not None:
            _keep_steps(trace, *steps)
        yield trace


def build_process_trace(pf: ProcessFiles, attempt: int, reader: Reader) -> ProcessTrace | None:
    """Pair one process's records into spans; None when it holds no valid record."""
    spans: dict[str, Span] = {}
    instants: list[dict] = []
    scalars: list[dict] = []
    meta: dict = {}
    first_ts: float | None = None
    last_ts = 0.0
    ended = False
    for rec in reader.records(pf):
        ts = float(rec[schema.TS])
        if first_ts is None:
            first_ts = ts
        last_ts = max(last_ts, ts)
        for key in (schema.HOST, schema.PID, schema.WORLD_SIZE):
            if key not in meta and rec.get(key) is not None:
                meta[key] = rec[key]
        kind = rec[schema.KIND]
        if kind == schema.SPAN_START:
            sid = str(rec.get(schema.SPAN_ID, ""))
            spans[sid] = Span(
                name=str(rec.get(schema.NAME, "")),
                span_id=sid,
                parent_span_id=rec.get(schema.PARENT_SPAN_ID),
                trace_id=str(rec.get(schema.TRACE_ID, "")),
                start_ts=ts,
                end_ts=None,
                status=STATUS_OPEN,
                tid=rec.get(schema.TID),
                step=rec.get(schema.STEP),
                attrs=dict(rec.get(schema.ATTRS) or {}),
            )
        elif kind == schema.SPAN_END:
            _end_span(spans, rec, ts)
        elif kind == schema.INSTANT:
            instants.append(rec)
            if rec.get(schema.NAME) == schema.INSTANT_PROCESS_END:
                ended = True
        elif kind == schema.SCALAR:
            scalars.append(rec)
    if first_ts is None:
        return None
    ordered = sorted(spans.values(), key=lambda s: s.start_ts)
    return ProcessTrace(
        source=pf.source,
        rank=pf.rank,
        attempt=attempt,
        host=meta.get(schema.HOST),
        pid=meta.get(schema.PID),
        world_size=meta.get(schema.WORLD_SIZE),
        first_ts=first_ts,
        last_ts=last_ts,
        spans=ordered,
        instants=instants,
        scalars=scalars,
        ended_cleanly=ended,
    )


def _end_span(spans: dict[str, Span], rec: dict, ts: float) -> None:
    sid = str(rec.get(schema.SPAN_ID, ""))
    span = spans.get(sid)
    if span is None:
        # Its start record was in a segment that rotated away: rebuild the start from the duration.
        dur = rec.get(schema.DUR_MS)
        start = ts - float(dur) / 1000.0 if isinstance(dur, (int, float)) else ts
        span = spans[sid] = Span(
            name=str(rec.get(schema.NAME, "")),
            span_id=sid,
            parent_span_id=rec.get(schema.PARENT_SPAN_ID),
            trace_id=str(rec.get(schema.TRACE_ID, "")),
            start_ts=start,
            end_ts=None,
            status=STATUS_OPEN,
            tid=rec.get(schema.TID),
            step=rec.get(schema.STEP),
        )
    span.end_ts = ts
    span.status = str(rec.get(schema.STATUS) or schema.STATUS_OK)
    span.error = rec.get(schema.ERROR)
    if rec.get(schema.ATTRS):
        span.attrs.update(rec[schema.ATTRS])


def _keep_steps(trace: ProcessTrace, lo: int, hi: int) -> None:
    def in_range(step: object) -> bool:
        return isinstance(step, int) and lo <= step <= hi

    times = [s.start_ts for s in trace.spans if in_range(s.step)]
    times += [s.end_ts for s in trace.spans if in_range(s.step) and s.end_ts is not None]
    times += [r[schema.TS] for r in (*trace.instants, *trace.scalars) if in_range(r.get(schema.STEP))]
    if not times:
        trace.spans, trace.instants, trace.scalars = [], [], []
        return
    t0, t1 = min(times), max(times)

    def keep_span(s: Span) -> bool:
        if s.step is not None:
            return in_range(s.step)
        end = s.end_ts if s.end_ts is not None else trace.last_ts
        return s.start_ts <= t1 and end >= t0

    def keep_record(r: dict) -> bool:
        step = r.get(schema.STEP)
        return in_range(step) if step is not None else t0 <= r[schema.TS] <= t1

    trace.spans = [s for s in trace.spans if keep_span(s)]
    trace.instants = [r for r in trace.instants if keep_record(r)]
    trace.scalars = [r for r in trace.scalars if keep_record(r)]
