"""The span model: start/end records paired into spans, one ``ProcessTrace`` per process attempt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
from msgspec.structs import asdict

from otel_train import schema
from otel_train.analysis.reader import ProcessFiles, Reader, assign_attempts, find_process_files

STATUS_OPEN = "open"
"""A span with a start record and no end record at all (the process died inside it)."""


class Span(msgspec.Struct, gc=False):
    """One span. ``end_ts`` is None while open; ``status``: ok, error, incomplete, or open.

    A msgspec Struct rather than a dataclass: a big run builds hundreds of thousands of them, and
    Struct construction is C code; ``gc=False`` because decoded JSON holds no reference cycles.
    """

    name: str
    span_id: str
    parent_span_id: str | None
    trace_id: str
    start_ts: float
    end_ts: float | None
    status: str
    tid: int | None
    step: int | None
    attrs: dict = msgspec.field(default_factory=dict)
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
    """Everything one process attempt wrote; ``ended_cleanly`` means a process_end instant was seen.

    ``instants`` and ``scalars`` are dicts of the record fields the analysis reads (``_Rec``'s fields,
    None when absent); other fields are not decoded.
    """

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
    for pf, attempt in process_order(path, ranks):
        trace = build_process_trace(pf, attempt, reader, steps)
        if trace is not None:
            yield trace


def process_order(path: str | Path, ranks: set[int] | None = None) -> list[tuple[ProcessFiles, int]]:
    """The run's processes (of ``ranks``, when given) with their attempts, sorted by rank, attempt, source."""
    pfs = [pf for pf in find_process_files(path) if ranks is None or pf.rank in ranks]
    attempts = assign_attempts(pfs)
    pfs.sort(key=lambda pf: (pf.rank, attempts[pf], pf.source))
    return [(pf, attempts[pf]) for pf in pfs]


class _Rec(msgspec.Struct, gc=False):
    # The fields the span model reads, typed loosely (``Any``) so that any record the generic reader
    # accepts (``v``, numeric ``ts``, string ``kind``) is accepted here too; the rest is skipped.
    v: Any
    ts: float
    kind: str
    name: Any = ""
    span_id: Any = ""
    parent_span_id: Any = None
    trace_id: Any = ""
    tid: Any = None
    step: Any = None
    dur_ms: Any = None
    status: Any = None
    error: Any = None
    attrs: Any = None
    values: Any = None


class _Meta(msgspec.Struct):
    ts: float
    host: Any = None
    pid: Any = None
    world_size: Any = None


_META_RECORDS = 64
_ts = attrgetter("ts")
_start_ts = attrgetter("start_ts")


def build_process_trace(
    pf: ProcessFiles, attempt: int, reader: Reader, steps: tuple[int, int] | None = None
) -> ProcessTrace | None:
    """Pair one process's records into spans, keeping only ``steps`` when given (see
    ``iter_process_traces``); None when it holds no valid record."""
    spans: dict[str, Span] = {}
    instants: list[dict] = []
    scalars: list[dict] = []
    first_ts: float | None = None
    last_ts = 0.0
    ended = False
    for items in reader.typed_batches(pf, _Rec):
        if not items:
            continue
        if first_ts is None:
            first_ts = items[0].ts
        last_ts = max(last_ts, max(map(_ts, items)))
        # The hot loop: one Span per start record, filled in place by its end record.
        for rec in items:
            kind = rec.kind
            if kind == _SPAN_END:
                span = spans.get(rec.span_id)
                if span is None or span.end_ts is not None:
                    _end_span(spans, rec)
                    continue
                span.end_ts = rec.ts
                status = rec.status
                span.status = status if type(status) is str and status else str(status or schema.STATUS_OK)
                span.error = rec.error
                if rec.attrs:
                    span.attrs.update(rec.attrs)
            elif kind == _SPAN_START:
                sid, name, attrs = rec.span_id, rec.name, rec.attrs
                sid = sid if type(sid) is str else str(sid)
                spans[sid] = Span(
                    name if type(name) is str else str(name),
                    sid,
                    rec.parent_span_id,
                    str(rec.trace_id),
                    rec.ts,
                    None,
                    STATUS_OPEN,
                    rec.tid,
                    rec.step,
                    attrs if type(attrs) is dict else {},
                )
            elif kind == _INSTANT:
                instants.append(asdict(rec))
                if rec.name == schema.INSTANT_PROCESS_END:
                    ended = True
            elif kind == _SCALAR:
                scalars.append(asdict(rec))
    if first_ts is None:
        return None
    meta = _meta(pf)
    trace = ProcessTrace(
        source=pf.source,
        rank=pf.rank,
        attempt=attempt,
        host=meta.get(schema.HOST),
        pid=meta.get(schema.PID),
        world_size=meta.get(schema.WORLD_SIZE),
        first_ts=first_ts,
        last_ts=last_ts,
        spans=sorted(spans.values(), key=_start_ts),
        instants=instants,
        scalars=scalars,
        ended_cleanly=ended,
    )
    if steps is not None:
        _keep_steps(trace, *steps)
    return trace


_SPAN_START, _SPAN_END, _INSTANT, _SCALAR = schema.SPAN_START, schema.SPAN_END, schema.INSTANT, schema.SCALAR


def _meta(pf: ProcessFiles) -> dict[str, Any]:
    """Host, pid and world size: the first non-null value of each among the process's first records."""
    meta: dict[str, Any] = {}
    quiet = Reader(warn=lambda _msg: None)
    for head in islice(quiet.typed(pf, _Meta), _META_RECORDS):
        for key in (schema.HOST, schema.PID, schema.WORLD_SIZE):
            value = getattr(head, key)
            if key not in meta and value is not None:
                meta[key] = value
    return meta


def _end_span(spans: dict[str, Span], rec: _Rec) -> None:
    sid = rec.span_id if type(rec.span_id) is str else str(rec.span_id)
    span = spans.get(sid)
    ts = rec.ts
    if span is None:
        # Its start record was in a segment that rotated away: rebuild the start from the duration.
        dur = rec.dur_ms
        start = ts - float(dur) / 1000.0 if isinstance(dur, (int, float)) else ts
        span = spans[sid] = Span(
            str(rec.name),
            sid,
            rec.parent_span_id,
            str(rec.trace_id),
            start,
            None,
            STATUS_OPEN,
            rec.tid,
            rec.step,
        )
    span.end_ts = ts
    span.status = str(rec.status or schema.STATUS_OK)
    span.error = rec.error
    if rec.attrs:
        span.attrs.update(rec.attrs)


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
