"""The lean span path: OTel API spans with ``__slots__``, for runs whose only sink is the JSONL processor.

The SDK span carries what an exporter needs (resource, scope, bounded attribute maps with a lock,
links, limits) and costs that on every ``start``/``end``. When nothing but the JSONL processor will
ever see a span, :class:`LeanTracer` makes :class:`LeanSpan` objects instead: real
``opentelemetry.trace.Span`` implementations (they live in the OTel context, so user OTel code nests
under them), with the same field names the JSONL encoder reads from SDK spans, handed to the same
``SpanProcessor`` interface. The runtime uses the SDK's tracer whenever OTLP, console or custom
handlers are configured, behind :class:`CleanTracer`, which makes user attributes safe for the SDK.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Iterator, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_train.record_clock import now_ns
from otel_train._report import safe_str
from otel_train._values import clean_text, otel_attributes

_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class LeanSpan(trace.Span):
    """A recording span with only what a JSONL record needs; ended once, by ``end()``."""

    __slots__ = ("_name", "_context", "_parent", "_start_time", "_end_time", "_attributes", "_status",
                 "_events", "_processor")

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None,
                 attributes: Mapping[str, Any] | None, processor: SpanProcessor | None) -> None:
        self._name = name
        self._context = context
        self._parent = parent
        self._attributes = dict(attributes) if attributes else None
        self._status = _UNSET
        self._events: list[Event] | None = None
        self._end_time: int | None = None
        self._processor = processor
        self._start_time = now_ns()  # the runtime's clock: a wall-clock step moves no span (docs/clock.md)

    # The public read side, as on SDK ReadableSpan, for processors that use it.
    name = property(lambda self: self._name)
    context = property(lambda self: self._context)
    parent = property(lambda self: self._parent)
    start_time = property(lambda self: self._start_time)
    end_time = property(lambda self: self._end_time)
    attributes = property(lambda self: dict(self._attributes or ()))
    status = property(lambda self: self._status)
    events = property(lambda self: tuple(self._events or ()))

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is None:
            if self._attributes is None:
                self._attributes = {}
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self._end_time is None:
            if self._events is None:
                self._events = []
            self._events.append(Event(name, attributes, timestamp))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        """Links are not recorded on the lean path: the JSONL schema has no field for them."""

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._end_time is None:
            self._status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        kind = type(exception)
        module = kind.__module__
        event = {
            "exception.type": kind.__qualname__ if module in (None, "builtins") else f"{module}.{kind.__qualname__}",
            "exception.message": safe_str(exception, 2000),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = now_ns() if end_time is None else end_time
        if self._processor is not None:
            self._processor.on_end(self)  # type: ignore[arg-type]


class _Tracer(trace.Tracer):
    """``start_as_current_span`` in terms of ``start_span``, for the two tracers below."""

    @contextlib.contextmanager
    def start_as_current_span(self, name: str, context: otel_context.Context | None = None,
                              kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
                              links: Sequence[Link] | None = None, start_time: int | None = None,
                              record_exception: bool = True, set_status_on_exception: bool = True,
                              end_on_exit: bool = True) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception) as current:
            yield current


class LeanTracer(_Tracer):
    """Makes :class:`LeanSpan` objects, handing each to ``processor`` at start and end."""

    def __init__(self, processor: SpanProcessor | None, id_generator: IdGenerator) -> None:
        self._processor = processor
        self._ids = id_generator

    def start_span(self, name: str, context: otel_context.Context | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
                   links: Sequence[Link] | None = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> LeanSpan:
        parent = trace.get_current_span(context).get_span_context()
        ids = self._ids
        if parent.is_valid:
            ctx = SpanContext(parent.trace_id, ids.generate_span_id(), False, _SAMPLED, parent.trace_state)
        else:
            parent = None
            ctx = SpanContext(ids.generate_trace_id(), ids.generate_span_id(), False, _SAMPLED)
        span = LeanSpan(name, ctx, parent, attributes, self._processor)
        if start_time is not None:
            span._start_time = start_time
        if self._processor is not None:
            self._processor.on_start(span)  # type: ignore[arg-type]
        return span


class CleanTracer(_Tracer):
    """The SDK's tracer behind a guard: names and attributes go through ``otel_attributes`` first.

    The SDK walks attribute values recursively and calls ``str()`` on what it does not know, so a
    circular dict, a 5,000-deep list or an object whose ``__str__`` raises would raise out of
    ``start_span`` into training; OTLP would also fail a whole batch on a lone surrogate or an
    integer beyond int64. Cleaned values are bounded and always encodable.
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start_span(self, name: str, context: otel_context.Context | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
                   links: Sequence[Link] | None = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> trace.Span:
        name = clean_text(name) if isinstance(name, str) else safe_str(name)
        span = self._tracer.start_span(name, context, kind, otel_attributes(attributes), links,
                                       now_ns() if start_time is None else start_time,
                                       record_exception, set_status_on_exception)
        return _on_runtime_clock(span)


def _on_runtime_clock(span: trace.Span) -> trace.Span:
    """An SDK span timed on the runtime's clock (docs/clock.md): its start was given, and ``end()``
    without a time takes :func:`~otel_train.record_clock.now_ns` instead of the SDK's wall clock. The JSONL
    encoder moves the times of other SDK spans (a user's own tracer on our provider) as it sees them."""
    sdk_end = span.end

    def end(end_time: int | None = None) -> None:
        sdk_end(now_ns() if end_time is None else end_time)

    try:
        span.end = end  # type: ignore[method-assign]
        span._runtime_clock = True  # type: ignore[attr-defined]
    except AttributeError:  # a span type that takes no attributes (non-recording): nothing is written of it
        pass
    return span
