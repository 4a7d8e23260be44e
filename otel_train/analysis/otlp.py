"""The span model as OpenTelemetry SDK spans: what ``otel-train push`` sends and ``otlp-json`` writes.

Each :class:`~otel_train.analysis.spans.Span` becomes an SDK ``ReadableSpan`` with its original trace,
span and parent ids and its recorded times, so pushing a run twice sends the same spans twice (a
backend keyed by span id keeps one). The SDK's own encoder and exporters take it from there.

* Resource, one per process (:func:`process_resource`): ``service.name`` ``otel-train`` <
  ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME`` (read by the SDK's ``OTELResourceDetector``) <
  an explicit service name < the identity the records carry (``host.name``, ``process.pid``,
  ``training.*``), as the live runtime builds it.
* Attributes: the span's own, plus ``training.step``/``relative_step``/``epoch``/``iteration``/``tags``
  from its start record and ``thread.id``.
* A span still open when its process stopped ends at the process's last record; it and a span ended
  by shutdown carry ``otel_train.incomplete=true``. An error span gets status ERROR (``Type: message``)
  and an ``exception`` event. Instants become events of their enclosing span; scalars have no place
  in OTLP traces and are counted as skipped.

docs/otlp.md ("Pushing trace files") describes what is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.semconv.attributes.exception_attributes import EXCEPTION_MESSAGE, EXCEPTION_TYPE
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_train import schema
from otel_train._version import __version__
from otel_train.analysis.records import Instant
from otel_train.analysis.spans import ProcessState, Span
from otel_train.phases import STEP

DEFAULT_SERVICE_NAME = "otel-train"
SCOPE = InstrumentationScope("otel_train", __version__)
THREAD_ID = "thread.id"  # OTel semantic conventions
EXCEPTION_EVENT = "exception"
_INT64 = (-(1 << 63), (1 << 63) - 1)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)

# Start-record fields that become span attributes (the runtime sets the same keys on live spans).
_CONTEXT_ATTRS = (
    ("step", schema.ATTR_STEP),
    ("relative_step", schema.ATTR_RELATIVE_STEP),
    ("epoch", schema.ATTR_EPOCH),
    ("iteration", schema.ATTR_ITERATION),
    ("tags", schema.ATTR_TAGS),
)


@dataclass(slots=True)
class Tally:
    """What the conversion made of a run's records."""

    processes: int = 0
    spans: int = 0
    incomplete_spans: int = 0
    events: int = 0
    instants_dropped: int = 0
    scalars_skipped: int = 0
    spans_without_ids: int = 0


# ---------------------------------------------------------------------------------------------
# Resources


def base_resource(service_name: str | None = None) -> Resource:
    """What every process's resource starts from: the default service name, the OTel env variables, ``service_name``."""
    out = Resource({schema.RES_SERVICE_NAME: DEFAULT_SERVICE_NAME}).merge(OTELResourceDetector().detect())
    if service_name:
        out = out.merge(Resource({schema.RES_SERVICE_NAME: service_name}))
    return out


def process_resource(state: ProcessState, base: Resource) -> Resource:
    """``base`` with the process's identity on top (the keys the runtime puts on live spans win)."""
    identity = {
        schema.RES_HOST: state.host,
        schema.RES_PID: state.pid,
        schema.RES_RANK: state.rank,
        schema.RES_LOCAL_RANK: state.local_rank,
        schema.RES_WORLD_SIZE: state.world_size,
        schema.RES_ATTEMPT: state.attempt,
        schema.RES_RUN_ID: state.run_id,
        schema.RES_JOB_ID: state.job_id,
        schema.RES_SOURCE: state.source,
    }
    return base.merge(Resource({k: v for k, v in identity.items() if v is not None}))


# ---------------------------------------------------------------------------------------------
# Attributes, events, spans


def attribute_value(value: Any) -> Any:
    """A record value as one the SDK encoder takes: ints beyond int64 and unknown types as text."""
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return value if _INT64[0] <= value <= _INT64[1] else str(value)
    if isinstance(value, (list, tuple)):
        return [attribute_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): attribute_value(v) for k, v in value.items()}
    return str(value)


def attributes(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """Record attributes as span attributes; ``None`` values are left out, as the SDK does."""
    return {str(k): attribute_value(v) for k, v in (values or {}).items() if v is not None}


def _ns(ts: float) -> int:
    return int(round(ts * 1e9))


def _id(value: str | None, size: int) -> int:
    """A hex id as the SDK's integer; 0 (invalid) when missing or malformed."""
    if not value or len(value) != 2 * size:
        return 0
    try:
        return int(value, 16)
    except ValueError:
        return 0


def instant_event(rec: Instant) -> Event:
    """An instant as a span event."""
    return Event(rec.name, attributes(rec.attrs), _ns(rec.ts))


def span_attributes(span: Span) -> dict[str, Any]:
    """The span's attributes, its start record's training context, its thread, and whether it was cut short."""
    out = attributes(span.attrs)
    context = span.context
    if context is not None:
        for field_name, key in _CONTEXT_ATTRS:
            value = getattr(context, field_name, None)
            if value is not None and key not in out:
                out[key] = attribute_value(value)
    if span.tid is not None:
        out[THREAD_ID] = span.tid
    if span.unclosed or span.end_ts is None:
        out[schema.ATTR_INCOMPLETE] = True
    return out


def to_readable(
    span: Span,
    resource: Resource,
    end_fallback_ts: float,
    events: Sequence[Event] = (),
    links: Sequence[Link] = (),
) -> ReadableSpan | None:
    """``span`` as an SDK span under ``resource``; None when it has no valid trace or span id.

    A span without an end ends at ``end_fallback_ts`` (its process's last record). ``links`` is where
    links to other spans (e.g. the same step on other ranks) go in.
    """
    trace_id, span_id = _id(span.trace_id, 16), _id(span.span_id, 8)
    if not trace_id or not span_id:
        return None
    parent_id = _id(span.parent_span_id, 8)
    start = _ns(span.start_ts)
    end = _ns(span.end_ts) if span.end_ts is not None else max(_ns(end_fallback_ts), start)
    status = Status(StatusCode.UNSET)
    if span.status == schema.STATUS_ERROR:
        err = span.error or {}
        etype, message = str(err.get("type", "Error")), str(err.get("message", ""))
        status = Status(StatusCode.ERROR, f"{etype}: {message}")
        events = [*events, Event(EXCEPTION_EVENT, {EXCEPTION_TYPE: etype, EXCEPTION_MESSAGE: message}, end)]
    return ReadableSpan(
        name=span.name,
        context=SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED),
        parent=SpanContext(trace_id, parent_id, is_remote=False, trace_flags=_SAMPLED) if parent_id else None,
        resource=resource,
        attributes=span_attributes(span),
        events=tuple(events),
        links=tuple(links),
        kind=SpanKind.INTERNAL,
        status=status,
        start_time=start,
        end_time=end,
        instrumentation_scope=SCOPE,
    )


def step_links(state: ProcessState) -> Callable[[Span], tuple[Link, ...]]:
    """The links the runtime gave a process's ``step`` spans, rebuilt from ids alone: a step span in its
    group's trace links to the step's anchor (rank 0's step span in group 0's trace), as
    ``otel_train.runtime`` does live (docs/deploy.md, "One step across groups")."""
    run_id, settings = state.run_id, state.settings
    size = settings.get("trace_group_size", 64)
    if not run_id or not settings.get("trace_per_step", True) or not isinstance(size, int) or size < 1:
        return lambda span: ()
    group, attempt = state.rank // size, state.attempt
    link_attrs = {schema.ATTR_LINK: schema.LINK_STEP_ANCHOR}

    def links(span: Span) -> tuple[Link, ...]:
        step = span.step
        if span.name != STEP or span.parent_span_id or step is None:
            return ()
        if span.trace_id != f"{schema.step_trace_id(run_id, step, group):032x}":
            return ()  # not a grouped step trace (another writer, another derivation)
        anchor = schema.step_anchor_span_id(run_id, step, attempt)
        if span.span_id == f"{anchor:016x}":
            return ()  # the anchor itself
        target = SpanContext(schema.step_trace_id(run_id, step, 0), anchor, is_remote=True, trace_flags=_SAMPLED)
        return (Link(target, link_attrs),)

    return links


def convert(spans: Iterable[Span], resource: Resource, end_fallback_ts: float,
            events: dict[str, list[Event]], tally: Tally,
            links: Callable[[Span], Sequence[Link]] = lambda span: ()) -> Iterator[ReadableSpan]:
    """``spans`` as SDK spans, each with its events (taken out of ``events``) and ``links(span)``,
    counted in ``tally``. Spans without valid ids are left out (counted, and their events as dropped
    instants)."""
    for span in spans:
        own = events.pop(span.span_id, [])
        out = to_readable(span, resource, end_fallback_ts, own, links(span))
        if out is None:
            tally.spans_without_ids += 1
            tally.instants_dropped += len(own)
            continue
        tally.spans += 1
        tally.events += len(own)
        if span.unclosed or span.end_ts is None:
            tally.incomplete_spans += 1
        yield out


def events_by_span(instants: Iterable[Instant], into: dict[str, list[Event]] | None = None,
                   tally: Tally | None = None) -> dict[str, list[Event]]:
    """Instants as events, grouped by their enclosing span's id; those outside any span are dropped (counted)."""
    out: dict[str, list[Event]] = {} if into is None else into
    for rec in instants:
        if rec.span_id:
            out.setdefault(rec.span_id, []).append(instant_event(rec))
        elif tally is not None:
            tally.instants_dropped += 1
    return out


def process_spans(state: ProcessState, resource: Resource, tally: Tally) -> Iterator[ReadableSpan]:
    """A finished ``keep=True`` state's spans (open ones too, in start order) as SDK spans, with their events.

    Instants whose span is not among them are dropped, scalars skipped; both are counted in ``tally``.
    """
    events = events_by_span(state.instants, tally=tally)
    yield from convert(state.spans, resource, state.last_ts or 0.0, events, tally, step_links(state))
    tally.instants_dropped += sum(map(len, events.values()))
    tally.scalars_skipped += len(state.scalars)
