"""Trace files to OTLP: ``ExportTraceServiceRequest`` batches for ``otel-train push``, and OTLP/JSON.

Records become OTLP spans with their original trace, span and parent ids and timestamps, grouped per
process under a resource rebuilt from the records (rank, host, pid, run id, job id, attempt, source,
``service.name``). Spans still open when a process stopped are sent too, ended at that process's last
timestamp and marked ``otel_train.incomplete``. Instants become span events on their enclosing span
(dropped when that span is unknown); scalars are skipped: OTLP traces have no place for them.

Ids are the originals, so pushing a run twice sends the same spans again: backends keyed by
(trace id, span id) keep one copy (Phoenix, Tempo after compaction), others may show both.

``follow`` tails a live run (new segments, rotation and new processes included) and ships each span
as it ends: a sidecar that gives OTLP without an exporter in the training processes.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from otel_train import schema
from otel_train._version import __version__
from otel_train.analysis.records import (
    BadLines,
    Tail,
    ProcessFiles,
    Reader,
    TraceReadError,
    find_process_files,
    logs_dir,
    warn_to_stderr,
)
from otel_train.analysis.spans import STATUS_OPEN, Span, assign_attempts

DEFAULT_SERVICE_NAME = "otel-train"
SCOPE_NAME = "otel_train"
INCOMPLETE_ATTR = schema.ATTR_INCOMPLETE  # same key the runtime sets on spans ended by shutdown
DEFAULT_BATCH_SPANS = 512
_INT64 = (-(1 << 63), (1 << 63) - 1)

# Record fields that become span attributes (the runtime sets the same keys on live spans).
_CONTEXT_ATTRS = (
    (schema.STEP, schema.ATTR_STEP),
    (schema.RELATIVE_STEP, schema.ATTR_RELATIVE_STEP),
    (schema.EPOCH, schema.ATTR_EPOCH),
    (schema.ITERATION, schema.ATTR_ITERATION),
    (schema.TAGS, schema.ATTR_TAGS),
)


class PushError(Exception):
    """The endpoint refused or could not be reached; one line naming the endpoint, never the headers."""


# ---------------------------------------------------------------------------------------------
# Values, resources, spans


def any_value(value: Any) -> AnyValue:
    """A Python attribute value as an OTLP ``AnyValue`` (unknown types as their ``str``)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        if _INT64[0] <= value <= _INT64[1]:
            return AnyValue(int_value=value)
        return AnyValue(string_value=str(value))
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, (list, tuple)):
        out = AnyValue()
        out.array_value.values.extend(any_value(v) for v in value)
        return out
    if isinstance(value, Mapping):
        out = AnyValue()
        out.kvlist_value.values.extend(key_values(value))
        return out
    return AnyValue(string_value=str(value))


def key_values(attrs: Mapping[str, Any]) -> list[KeyValue]:
    """Attributes as OTLP ``KeyValue``s; ``None`` values are left out, as the SDK does."""
    return [KeyValue(key=str(k), value=any_value(v)) for k, v in attrs.items() if v is not None]


@dataclass(frozen=True, slots=True)
class ProcessMeta:
    """Who wrote a process's records: becomes its OTLP resource."""

    source: str
    rank: int
    attempt: int
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    run_id: str | None = None
    job_id: str | None = None

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], *, source: str, rank: int, attempt: int | None) -> ProcessMeta:
        """Identity from one record; the file name's source and rank win, the record's attempt if none given."""
        rec_attempt = rec.get(schema.ATTEMPT)
        return cls(
            source=source,
            rank=rank,
            attempt=attempt if attempt is not None else (rec_attempt if isinstance(rec_attempt, int) else 0),
            host=rec.get(schema.HOST),
            pid=rec.get(schema.PID),
            local_rank=rec.get(schema.LOCAL_RANK),
            world_size=rec.get(schema.WORLD_SIZE),
            run_id=rec.get(schema.RUN_ID),
            job_id=rec.get(schema.JOB_ID),
        )

    def resource(self, service_name: str, extra: Mapping[str, Any] | None = None) -> Resource:
        """The OTLP resource: ``extra`` (e.g. OTEL_RESOURCE_ATTRIBUTES) < the runtime's keys (``schema.RES_*``)."""
        attrs = {
            **(extra or {}),
            schema.RES_SERVICE_NAME: service_name,
            schema.RES_HOST: self.host,
            schema.RES_PID: self.pid,
            schema.RES_RANK: self.rank,
            schema.RES_LOCAL_RANK: self.local_rank,
            schema.RES_WORLD_SIZE: self.world_size,
            schema.RES_ATTEMPT: self.attempt,
            schema.RES_RUN_ID: self.run_id,
            schema.RES_JOB_ID: self.job_id,
            schema.RES_SOURCE: self.source,
        }
        return Resource(attributes=key_values(attrs))


def _ns(ts: float) -> int:
    return int(round(ts * 1e9))


def _hex_bytes(value: str | None, size: int) -> bytes:
    if not value:
        return b""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return b""
    return raw if len(raw) == size else b""


def span_to_proto(span: Span, events: Iterable[Mapping[str, Any]], end_fallback_ts: float) -> PbSpan:
    """One span as OTLP; an unclosed span ends at ``end_fallback_ts`` and is marked incomplete."""
    unclosed = span.end_ts is None or span.status in (STATUS_OPEN, schema.STATUS_INCOMPLETE)
    end_ts = span.end_ts if span.end_ts is not None else max(end_fallback_ts, span.start_ts)
    attrs = dict(span.attrs or {})
    if span.tid is not None:
        attrs["thread.id"] = span.tid
    if unclosed:
        attrs[INCOMPLETE_ATTR] = True
    out = PbSpan(
        trace_id=_hex_bytes(span.trace_id, 16),
        span_id=_hex_bytes(span.span_id, 8),
        parent_span_id=_hex_bytes(span.parent_span_id, 8),
        name=span.name,
        kind=PbSpan.SPAN_KIND_INTERNAL,
        start_time_unix_nano=_ns(span.start_ts),
        end_time_unix_nano=_ns(end_ts),
        attributes=key_values(attrs),
    )
    for ev in events:
        out.events.add(
            name=str(ev.get(schema.NAME, "")),
            time_unix_nano=_ns(float(ev[schema.TS])),
            attributes=key_values(ev.get(schema.ATTRS) or {}),
        )
    if span.status == schema.STATUS_ERROR:
        err = span.error or {}
        etype, emsg = str(err.get("type", "Error")), str(err.get("message", ""))
        out.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message=f"{etype}: {emsg}"))
        out.events.add(
            name="exception",
            time_unix_nano=_ns(end_ts),
            attributes=key_values({"exception.type": etype, "exception.message": emsg}),
        )
    return out


# ---------------------------------------------------------------------------------------------
# Assembling records into spans, one process at a time


@dataclass(slots=True)
class ReplayStats:
    """What a replay sent (or wrote)."""

    processes: int = 0
    spans: int = 0
    incomplete_spans: int = 0
    events: int = 0
    instants_dropped: int = 0
    scalars_skipped: int = 0
    requests: int = 0
    malformed_lines: int = 0

    def summary(self) -> str:
        """One line for the CLI's final count."""
        return (
            f"{self.spans} spans ({self.incomplete_spans} incomplete) from {self.processes} processes "
            f"in {self.requests} requests; {self.events} instants as span events, "
            f"{self.instants_dropped} instants without an enclosing span dropped, "
            f"{self.scalars_skipped} scalars skipped (OTLP traces carry no scalars)"
        )


@dataclass(slots=True)
class _Pending:
    span: Span
    events: list[dict] = field(default_factory=list)


class SpanAssembler:
    """Pairs one process's start/end records into spans as they arrive; instants become their events.

    ``feed`` returns the spans an end record closed; ``close`` ends what is still open (incomplete,
    at the process's last timestamp). Used for whole files and for tailing live ones.
    """

    def __init__(self, source: str, rank: int, attempt: int | None, stats: ReplayStats) -> None:
        self.source, self.rank, self.attempt = source, rank, attempt
        self.meta: ProcessMeta | None = None
        self.last_ts = 0.0
        self._open: dict[str, _Pending] = {}
        self._stats = stats

    def feed(self, rec: Mapping[str, Any]) -> list[PbSpan]:
        """Take one record; returns the spans it ended, as OTLP."""
        ts = float(rec[schema.TS])
        self.last_ts = max(self.last_ts, ts)
        if self.meta is None:
            self.meta = ProcessMeta.from_record(rec, source=self.source, rank=self.rank, attempt=self.attempt)
        kind = rec[schema.KIND]
        if kind == schema.SPAN_START:
            span = _span_from(rec, ts)
            self._open[span.span_id] = _Pending(span)
        elif kind == schema.SPAN_END:
            return [self._end(rec, ts)]
        elif kind == schema.INSTANT:
            pending = self._open.get(str(rec.get(schema.SPAN_ID, "")))
            if pending is None:
                self._stats.instants_dropped += 1
            else:
                pending.events.append(dict(rec))
        elif kind == schema.SCALAR:
            self._stats.scalars_skipped += 1
        return []

    def close(self) -> list[PbSpan]:
        """End every still-open span as incomplete at the last timestamp seen (outermost first)."""
        pending = sorted(self._open.values(), key=lambda p: p.span.start_ts)
        self._open.clear()
        return [self._emit(p) for p in pending]

    def _end(self, rec: Mapping[str, Any], ts: float) -> PbSpan:
        pending = self._open.pop(str(rec.get(schema.SPAN_ID, "")), None)
        if pending is None:
            # Its start rotated away before we read it: rebuild the start from the duration.
            dur = rec.get(schema.DUR_MS)
            start = ts - float(dur) / 1000.0 if isinstance(dur, (int, float)) else ts
            pending = _Pending(_span_from(rec, start))
        span = pending.span
        span.end_ts = ts
        span.status = str(rec.get(schema.STATUS) or schema.STATUS_OK)
        span.error = rec.get(schema.ERROR)
        if rec.get(schema.ATTRS):
            span.attrs.update(rec[schema.ATTRS])
        return self._emit(pending)

    def _emit(self, pending: _Pending) -> PbSpan:
        span = pending.span
        if span.end_ts is None or span.status in (STATUS_OPEN, schema.STATUS_INCOMPLETE):
            self._stats.incomplete_spans += 1
        self._stats.spans += 1
        self._stats.events += len(pending.events)
        return span_to_proto(span, pending.events, self.last_ts)


def _span_from(rec: Mapping[str, Any], start_ts: float) -> Span:
    attrs = dict(rec.get(schema.ATTRS) or {})
    for field_name, attr in _CONTEXT_ATTRS:
        if rec.get(field_name) is not None and attr not in attrs:
            attrs[attr] = rec[field_name]
    step = rec.get(schema.STEP)
    return Span(
        name=str(rec.get(schema.NAME, "")),
        span_id=str(rec.get(schema.SPAN_ID, "")),
        parent_span_id=rec.get(schema.PARENT_SPAN_ID),
        trace_id=str(rec.get(schema.TRACE_ID, "")),
        start_ts=start_ts,
        end_ts=None,
        status=STATUS_OPEN,
        tid=rec.get(schema.TID),
        step=step if isinstance(step, int) else None,
        attrs=attrs,
    )


# ---------------------------------------------------------------------------------------------
# Batching into requests


class RequestBatcher:
    """Groups OTLP spans per process resource into ``ExportTraceServiceRequest``s of at most ``max_spans``."""

    def __init__(
        self,
        service_name: str,
        max_spans: int = DEFAULT_BATCH_SPANS,
        extra_resource: Mapping[str, Any] | None = None,
    ) -> None:
        self.service_name = service_name
        self.extra_resource = dict(extra_resource or {})
        self.max_spans = max(1, max_spans)
        self._request = ExportTraceServiceRequest()
        self._scopes: dict[ProcessMeta, ScopeSpans] = {}
        self._count = 0

    def add(self, meta: ProcessMeta, spans: Iterable[PbSpan]) -> list[ExportTraceServiceRequest]:
        """Queue spans; returns the requests that filled up."""
        full = []
        for span in spans:
            scope = self._scopes.get(meta)
            if scope is None:
                rs = self._request.resource_spans.add(resource=meta.resource(self.service_name, self.extra_resource))
                scope = rs.scope_spans.add(scope=InstrumentationScope(name=SCOPE_NAME, version=__version__))
                self._scopes[meta] = scope
            scope.spans.append(span)
            self._count += 1
            if self._count >= self.max_spans:
                full.append(self.take())
        return full

    def take(self) -> ExportTraceServiceRequest:
        """The queued request (possibly empty), starting a new one."""
        request = self._request
        self._request, self._scopes, self._count = ExportTraceServiceRequest(), {}, 0
        return request

    @property
    def pending(self) -> int:
        """Spans queued and not yet taken."""
        return self._count


def iter_process_spans(
    path: str | Path,
    reader: Reader,
    stats: ReplayStats,
    *,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
) -> Iterator[tuple[ProcessMeta, list[PbSpan]]]:
    """Each process's spans as OTLP (one process in memory at a time), sorted by rank then attempt.

    ``steps=(lo, hi)`` keeps spans whose ``training.step`` is in range, and spans without a step that
    overlap the in-range spans in time (their enclosing ``run``/epoch-level spans). Raises TraceReadError.
    """
    pfs = [pf for pf in find_process_files(path) if ranks is None or pf.rank in ranks]
    attempts = assign_attempts(pfs)
    pfs.sort(key=lambda pf: (pf.rank, attempts[pf], pf.source))
    for pf in pfs:
        assembler = SpanAssembler(pf.source, pf.rank, attempts[pf], stats)
        spans: list[PbSpan] = []
        for rec in reader.records(pf):
            spans.extend(assembler.feed(rec))
        spans.extend(assembler.close())
        if assembler.meta is None:
            continue
        if steps is not None:
            spans = _keep_steps(spans, *steps)
        stats.processes += 1
        yield assembler.meta, spans
    stats.malformed_lines = reader.malformed_lines


def _step_of(span: PbSpan) -> int | None:
    for kv in span.attributes:
        if kv.key == schema.ATTR_STEP and kv.value.WhichOneof("value") == "int_value":
            return kv.value.int_value
    return None


def _keep_steps(spans: list[PbSpan], lo: int, hi: int) -> list[PbSpan]:
    stepped = [(s, _step_of(s)) for s in spans]
    inside = [s for s, step in stepped if step is not None and lo <= step <= hi]
    if not inside:
        return []
    t0 = min(s.start_time_unix_nano for s in inside)
    t1 = max(s.end_time_unix_nano for s in inside)
    return [
        s
        for s, step in stepped
        if (step is not None and lo <= step <= hi)
        or (step is None and s.start_time_unix_nano <= t1 and s.end_time_unix_nano >= t0)
    ]


# ---------------------------------------------------------------------------------------------
# Senders


class Sender(Protocol):
    """Ships one request; raises PushError."""

    endpoint: str

    def send(self, request: ExportTraceServiceRequest) -> None: ...

    def close(self) -> None: ...


RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
"""Backoff before each retry of a transient failure (then the push fails)."""


class GrpcSender:
    """OTLP/gRPC ``TraceService.Export`` over a plain grpc channel (TLS for ``https://``)."""

    _RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")

    def __init__(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        timeout_s: float = 10.0,
        retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S,
    ) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

        parsed = urllib.parse.urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        if not parsed.hostname or not parsed.port:
            raise PushError(f"{endpoint}: gRPC endpoint needs host and port, e.g. http://127.0.0.1:4317")
        self.endpoint = endpoint
        target = f"{parsed.hostname}:{parsed.port}"
        if parsed.scheme == "https":
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials())
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = TraceServiceStub(self._channel)
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._timeout_s = timeout_s
        self._retry_delays_s = retry_delays_s
        self._grpc = grpc

    def send(self, request: ExportTraceServiceRequest) -> None:
        """Export with retries on transient gRPC codes."""
        for delay in (*self._retry_delays_s, None):
            try:
                self._stub.Export(request, metadata=self._metadata, timeout=self._timeout_s)
                return
            except self._grpc.RpcError as exc:
                code = exc.code().name if exc.code() is not None else "UNKNOWN"
                if delay is None or code not in self._RETRYABLE:
                    raise PushError(f"{self.endpoint}: OTLP/gRPC export failed: {code} {exc.details() or ''}".strip()) from None
                time.sleep(delay)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


class HttpSender:
    """OTLP/HTTP protobuf ``POST`` (gzip) to ``<endpoint>/v1/traces`` (kept as is when the path ends so)."""

    _RETRYABLE = (429, 502, 503, 504)

    def __init__(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        timeout_s: float = 10.0,
        retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S,
    ) -> None:
        parsed = urllib.parse.urlparse(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise PushError(f"{endpoint}: HTTP endpoint must be an http(s) URL, e.g. http://127.0.0.1:4318")
        path = parsed.path.rstrip("/")
        if not path.endswith("/v1/traces"):
            path += "/v1/traces"
        self.endpoint = endpoint
        self.url = urllib.parse.urlunparse(parsed._replace(path=path))
        self._headers = {
            **headers,
            "Content-Type": "application/x-protobuf",
            "Content-Encoding": "gzip",
            "User-Agent": f"otel-train/{__version__}",
        }
        self._timeout_s = timeout_s
        self._retry_delays_s = retry_delays_s

    def send(self, request: ExportTraceServiceRequest) -> None:
        """POST with retries on 429/5xx and connection errors."""
        body = gzip.compress(request.SerializeToString())
        for delay in (*self._retry_delays_s, None):
            req = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
                    resp.read()
                return
            except urllib.error.HTTPError as exc:
                retry, reason = exc.code in self._RETRYABLE, f"HTTP {exc.code} {exc.reason}"
            except (urllib.error.URLError, OSError) as exc:
                retry, reason = True, str(getattr(exc, "reason", exc))
            if delay is None or not retry:
                raise PushError(f"{self.url}: OTLP/HTTP export failed: {reason}")
            time.sleep(delay)

    def close(self) -> None:
        """Nothing held between requests."""


PROTOCOLS = ("grpc", "http/protobuf")


def make_sender(
    endpoint: str,
    protocol: str,
    headers: Mapping[str, str],
    timeout_s: float = 10.0,
    retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S,
) -> Sender:
    """A sender for ``protocol`` (``grpc`` or ``http/protobuf``); raises PushError on a bad endpoint."""
    if protocol == "grpc":
        return GrpcSender(endpoint, headers, timeout_s, retry_delays_s)
    if protocol == "http/protobuf":
        return HttpSender(endpoint, headers, timeout_s, retry_delays_s)
    raise PushError(f"protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")


def parse_headers(pairs: Iterable[str]) -> dict[str, str]:
    """``K=V`` strings (and comma-separated lists of them, as in OTEL_EXPORTER_OTLP_HEADERS) to a dict.

    The error names the offending key only: a value may be a secret.
    """
    out: dict[str, str] = {}
    for pair in pairs:
        for item in pair.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise PushError(f"header #{len(out) + 1}: expected KEY=VALUE (text not shown: it may be a secret)")
            out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return out


# ---------------------------------------------------------------------------------------------
# Replay (whole files) and follow (live files)


def _shipper(sender: Sender, stats: ReplayStats,
             on_spans: Callable[[int], None] | None) -> Callable[[ExportTraceServiceRequest], None]:
    """Sends non-empty requests, counting them and reporting each one's span count to ``on_spans``."""

    def ship(request: ExportTraceServiceRequest) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        if n:
            sender.send(request)
            stats.requests += 1
            if on_spans is not None:
                on_spans(n)

    return ship


def replay(
    path: str | Path,
    sender: Sender,
    *,
    service_name: str = DEFAULT_SERVICE_NAME,
    batch_spans: int = DEFAULT_BATCH_SPANS,
    extra_resource: Mapping[str, Any] | None = None,
    reader: Reader | None = None,
    on_spans: Callable[[int], None] | None = None,
) -> ReplayStats:
    """Send every span of a run (closed, incomplete and open ones) in batches; raises TraceReadError, PushError."""
    stats = ReplayStats()
    batcher = RequestBatcher(service_name, batch_spans, extra_resource)

    ship = _shipper(sender, stats, on_spans)

    for meta, spans in iter_process_spans(path, reader or Reader(), stats):
        for request in batcher.add(meta, spans):
            ship(request)
    ship(batcher.take())
    return stats


def follow(
    path: str | Path,
    sender: Sender,
    *,
    service_name: str = DEFAULT_SERVICE_NAME,
    batch_spans: int = DEFAULT_BATCH_SPANS,
    extra_resource: Mapping[str, Any] | None = None,
    poll_s: float = 0.5,
    idle_exit_s: float | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    warn: Callable[[str], None] | None = None,
    on_spans: Callable[[int], None] | None = None,
) -> ReplayStats:
    """Tail a live run and send each span when it ends, until ``should_stop()`` or ``idle_exit_s`` without new records.

    On exit, spans still open are sent as incomplete (ended at their process's last timestamp);
    if the run goes on, their real end arrives later with the same ids and a backend that keys spans
    by id keeps one of the two. Raises TraceReadError (path missing) and PushError.
    """
    stats = ReplayStats()
    tailer = Tail(Path(path), BadLines(warn or warn_to_stderr))
    assemblers: dict[tuple[str, int, str], SpanAssembler] = {}
    batcher = RequestBatcher(service_name, batch_spans, extra_resource)

    ship = _shipper(sender, stats, on_spans)

    last_activity = time.monotonic()
    while True:
        for pf, records in tailer.poll():
            key = (pf.source, pf.rank, pf.instance)
            assembler = assemblers.get(key)
            if assembler is None:
                assembler = assemblers[key] = SpanAssembler(pf.source, pf.rank, None, stats)
                stats.processes += 1
            ended = [span for rec in records for span in assembler.feed(msgspec.to_builtins(rec))]
            for request in batcher.add(assembler.meta, ended):  # type: ignore[arg-type]
                ship(request)
            last_activity = time.monotonic()
        ship(batcher.take())
        stats.malformed_lines = tailer.malformed_lines
        idle = idle_exit_s is not None and time.monotonic() - last_activity >= idle_exit_s
        if idle or should_stop():
            break
        time.sleep(poll_s)
    for assembler in assemblers.values():
        if assembler.meta is not None:
            for request in batcher.add(assembler.meta, assembler.close()):
                ship(request)
    ship(batcher.take())
    return stats


# ---------------------------------------------------------------------------------------------
# OTLP/JSON


def _hexify_ids(obj: Any) -> None:
    """OTLP/JSON writes trace and span ids as hex, not protobuf-JSON's base64."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                obj[key] = base64.b64decode(value).hex() if value else ""
            else:
                _hexify_ids(value)
    elif isinstance(obj, list):
        for item in obj:
            _hexify_ids(item)


def request_to_otlp_json(request: ExportTraceServiceRequest) -> dict:
    """An export request in OTLP/JSON form (camelCase keys, hex ids, integer enums)."""
    out = json_format.MessageToDict(request, use_integers_for_enums=True)
    _hexify_ids(out)
    return out


def export_otlp_json(
    path: str | Path,
    output: str | Path,
    *,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
    reader: Reader | None = None,
    service_name: str = DEFAULT_SERVICE_NAME,
    extra_resource: Mapping[str, Any] | None = None,
) -> int:
    """Write the run as one OTLP/JSON ``ExportTraceServiceRequest`` (Jaeger UI: Upload JSON); returns spans written.

    Streams one process at a time to ``output`` (parent directories created). Raises TraceReadError.
    """
    stats = ReplayStats()
    written = 0
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write('{"resourceSpans": [')
        first = True
        for meta, spans in iter_process_spans(path, reader or Reader(), stats, ranks=ranks, steps=steps):
            batcher = RequestBatcher(service_name, len(spans) + 1, extra_resource)
            batcher.add(meta, spans)
            written += len(spans)
            for rs in request_to_otlp_json(batcher.take()).get("resourceSpans", []):
                f.write(("" if first else ",\n") + json.dumps(rs, separators=(",", ":")))
                first = False
        f.write("]}\n")
    os.replace(tmp, out)
    return written
