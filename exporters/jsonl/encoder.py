"""Schema-v1 record encoding: one JSON object per line, as bytes.

This is the hot path of every span, so a record is assembled from pre-encoded JSON fragments (run
context, step context, per-name headers, caller) rather than built as a dict and serialised. Field
names come from ``otel_train.schema`` — the one module the analysis side shares.
"""

from __future__ import annotations

import os
import sys
from types import CodeType
from typing import Any, Mapping

import msgspec
from opentelemetry.trace import SpanContext, StatusCode

from otel_train import schema as S
from otel_train.record_clock import from_wall, now_ns
from otel_train._values import clean_text, json_safe
from otel_train.context import StepState, call_site
from otel_train.tracers import LeanSpan

INCOMPLETE_ATTR = S.ATTR_INCOMPLETE


def _fallback(obj: Any) -> Any:
    # Attribute values JSON can't hold (numpy scalars, paths, enums...) are written as text, never dropped.
    return str(obj)


encode_json = msgspec.json.Encoder(enc_hook=_fallback).encode


def _frag(key: str, value: Any) -> str:
    """``,"key":<json value>`` — one field, ready to splice into a record.

    Values the fast encoding refuses (a lone surrogate, a circular or very deep container, a
    ``__str__`` that raises) are written through ``json_safe``: bounded, with replacement characters.
    """
    try:
        text = encode_json(value)
    except Exception:  # noqa: BLE001 - whatever user values raise, the record is still written
        text = encode_json(json_safe(value))
    return f',"{key}":{text.decode()}'


def _step_fragment(state: StepState) -> str:
    # Memoised on the snapshot: snapshots never change once made.
    cached = state.sink_cache
    if cached is None:
        parts = []
        if state.step is not None:
            parts.append(f',"{S.STEP}":{state.step},"{S.RELATIVE_STEP}":{state.relative_step}')
        if state.epoch is not None:
            parts.append(f',"{S.EPOCH}":{state.epoch}')
        if state.iteration is not None:
            parts.append(f',"{S.ITERATION}":{state.iteration}')
        if state.tags:
            parts.append(_frag(S.TAGS, list(state.tags)))
        cached = state.sink_cache = "".join(parts)
    return cached  # type: ignore[return-value]


class CallerFinder:
    """Finds the first frame outside the given library directories; returns its ``caller`` fragment."""

    __slots__ = ("_skip", "_cache")

    def __init__(self, skip_dirs: tuple[str, ...]) -> None:
        self._skip = tuple(d.rstrip(os.sep) + os.sep for d in skip_dirs)
        self._cache: dict[tuple[CodeType, int], str] = {}

    def __call__(self) -> str:
        # Start from the API call's own frame when it left one; otherwise walk up from our caller.
        frame = call_site.frame or sys._getframe(2)
        skip = self._skip
        while frame is not None and frame.f_code.co_filename.startswith(skip):
            frame = frame.f_back
        if frame is None:
            return ""
        code = frame.f_code
        key = (code, frame.f_lasti)  # the instruction offset: cheaper than f_lineno, which decodes a table
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) > 4096:  # bounded: generated code could mint endless keys
                self._cache.clear()
            found = self._cache[key] = _frag(S.CALLER, f"{code.co_filename}:{frame.f_lineno}:{code.co_name}")
        return found


# The hot path reads the SDK span's fields directly: its public properties copy (attributes) or add a
# call per field, which together cost more than the whole record. check_sdk_span_fields() guards this.
SDK_SPAN_FIELDS = ("_name", "_context", "_parent", "_start_time", "_end_time", "_attributes", "_status")


def check_sdk_span_fields() -> None:
    """Raise RuntimeError if this opentelemetry-sdk's spans lack the fields the encoder reads."""
    from opentelemetry.sdk.trace import ReadableSpan

    missing = [field for field in SDK_SPAN_FIELDS if not hasattr(ReadableSpan(name="probe"), field)]
    if missing:
        raise RuntimeError(f"this opentelemetry-sdk's spans lack {', '.join(missing)}; "
                           "install an opentelemetry-sdk release otel-train supports (see pyproject.toml)")


class RecordEncoder:
    """Encodes span starts/ends, instants and scalars; ``static`` holds the run-context fields.

    A span's ids, step context, run context and thread form its *body*, made once at start
    (:meth:`span_body`) and shared by its start and end lines.
    """

    __slots__ = ("_static", "_start_heads", "_end_heads", "_point_heads", "_scalar_head", "_hex", "_skip_context")

    def __init__(self, static: Mapping[str, Any], *, skip_context_attrs: bool = False) -> None:
        self._static = "".join(_frag(k, v) for k, v in static.items())
        self._start_heads: dict[str, str] = {}
        self._end_heads: dict[str, str] = {}
        self._point_heads: dict[str, str] = {}
        self._scalar_head = _frag(S.KIND, S.SCALAR) + _frag(S.EVENT, S.SCALAR) + _frag(S.NAME, S.SCALAR)
        self._hex: tuple[int, str] = (0, "")
        # True when other sinks see spans: the training.* copies of the step context (step_context_attrs)
        # are left out of span_end lines, which carry the step context as fields of their own.
        self._skip_context = skip_context_attrs

    def _span_head(self, heads: dict[str, str], kind: str, suffix: str, name: str) -> str:
        """``,"kind":..,"event":..,"name":..`` of a span record, cached per name."""
        if len(heads) > 4096:  # names should be low-cardinality; don't grow without bound
            heads.clear()
        head = heads[name] = _frag(S.KIND, kind) + _frag(S.EVENT, name + suffix) + _frag(S.NAME, name)
        return head

    def span_body(self, span: Any, state: StepState, tid: int) -> str:
        """Ids, step context, run context and thread of a span: the part its two lines share."""
        ctx, parent = span._context, span._parent
        return self.op_body(ctx.trace_id, ctx.span_id, None if parent is None else parent.span_id, state, tid)

    def op_body(self, trace_id: int, span_id: int, parent_id: int | None, state: StepState, tid: int) -> str:
        """:meth:`span_body` of a span known only by its ids (an op's arrival, written before its span exists)."""
        # Spans mostly arrive in runs of one trace: a one-entry cache saves formatting the trace id.
        last_id, trace_part = self._hex
        if last_id != trace_id:
            trace_part = ',"%s":"%032x"' % (S.TRACE_ID, trace_id)
            self._hex = (trace_id, trace_part)
        step = state.sink_cache
        if step is None:
            step = _step_fragment(state)
        if parent_id is not None:
            return _BODY_WITH_PARENT % (trace_part, span_id, parent_id, step, self._static, tid)
        return _BODY % (trace_part, span_id, step, self._static, tid)

    def op_start(self, name: str, body: str, seq: int, start_ns: int, attrs: Mapping[str, Any]) -> bytes:
        """The ``span_start`` line of such a span (no caller), started at ``start_ns`` on the records' clock."""
        head = self._start_heads.get(name) or self._span_head(self._start_heads, S.SPAN_START, S.START_SUFFIX, name)
        return (_START_LINE % (start_ns // 1_000_000_000, start_ns // 1000 % 1_000_000, head, body, seq, "",
                               _frag(S.ATTRS, attrs))).encode()

    def _attrs(self, attributes: Mapping[str, Any], state: StepState | None = None) -> str:
        # Only the runtime's own copies are left out (a key of step_context_attrs holding the value the
        # copy would): every attribute the user gave, training.* ones included, is written.
        copied = step_context_attrs(state) if state is not None and self._skip_context else None
        if copied:
            attrs = {k: v for k, v in attributes.items()
                     if k != INCOMPLETE_ATTR and (k not in copied or copied[k] != v)}
        else:
            attrs = {k: v for k, v in attributes.items() if k != INCOMPLETE_ATTR}
        return _frag(S.ATTRS, attrs) if attrs else ""

    def span_start(self, span: Any, body: str, seq: int, caller: str) -> bytes:
        """The ``span_start`` line of an SDK span that has just started."""
        name = span._name
        head = self._start_heads.get(name) or self._span_head(self._start_heads, S.SPAN_START, S.START_SUFFIX, name)
        attributes = span._attributes
        ns = span._start_time
        if type(span) is not LeanSpan and not getattr(span, "_runtime_clock", False):
            ns = span._start_time = from_wall(ns)  # an SDK span timed by the SDK's wall clock: on ours
        return (_START_LINE % (
            ns // 1_000_000_000, ns // 1000 % 1_000_000, head, body, seq, caller,
            self._attrs(attributes) if attributes else "")).encode()

    def span_end(self, span: Any, body: str, seq: int, *, incomplete: bool = False,
                 state: StepState | None = None) -> bytes:
        """The ``span_end`` line of an SDK span that has just ended (or, ``incomplete``, is ended now);
        ``state`` is the step context it started in (its training.* copies are not repeated)."""
        name = span._name
        head = self._end_heads.get(name) or self._span_head(self._end_heads, S.SPAN_END, S.END_SUFFIX, name)
        start, end = span._start_time, span._end_time
        if end is not None and type(span) is not LeanSpan and not getattr(span, "_runtime_clock", False):
            end = span._end_time = from_wall(end)  # an SDK span's wall-clock end, just taken: on ours
        attributes = span._attributes
        if attributes and attributes.get(INCOMPLETE_ATTR) or incomplete:
            status = _INCOMPLETE
            if end is None:  # ended by shutdown without its own end()
                end = now_ns()
        elif span._status.status_code is StatusCode.ERROR:
            status = _ERROR + _frag(S.ERROR, _error_of(span))
        else:
            status = _OK
        dur_us = (end - start) // 1000
        return (_END_LINE % (
            end // 1_000_000_000, end // 1000 % 1_000_000, head, body, seq, dur_us // 1000, dur_us % 1000,
            status, self._attrs(attributes, state) if attributes else "")).encode()

    def instant(self, *, name: str, ts_ns: int, ids: SpanContext, state: StepState, tid: int, seq: int,
                caller: str, attrs: Mapping[str, Any] | None) -> bytes:
        """An ``instant`` line inside the span ``ids`` (an invalid context: none)."""
        head = self._point_heads.get(name) or self._point_head(S.INSTANT, name, name)
        return self._point(head, ts_ns, ids, state, tid, seq, caller, _frag(S.ATTRS, dict(attrs)) if attrs else "")

    def scalar(self, *, ts_ns: int, ids: SpanContext, state: StepState, tid: int, seq: int, caller: str,
               values: Mapping[str, Any]) -> bytes:
        """A ``scalar`` line inside the span ``ids`` (an invalid context: none)."""
        head = self._scalar_head
        return self._point(head, ts_ns, ids, state, tid, seq, caller, _frag(S.VALUES, dict(values)) if values else "")

    def _point_head(self, kind: str, event: str, name: str) -> str:
        if len(self._point_heads) > 4096:  # names should be low-cardinality; don't grow without bound
            self._point_heads.clear()
        head = self._point_heads[name] = _frag(S.KIND, kind) + _frag(S.EVENT, event) + _frag(S.NAME, name)
        return head

    def _point(self, head: str, ts_ns: int, ids: SpanContext, state: StepState, tid: int, seq: int, caller: str,
               payload: str) -> bytes:
        span_id = ids.span_id
        id_part = _POINT_IDS % (ids.trace_id, span_id) if span_id else ""
        return (_POINT_LINE % (
            ts_ns // 1_000_000_000, ts_ns // 1000 % 1_000_000, head, id_part, _step_fragment(state), self._static,
            tid, seq, caller, payload)).encode()


# Line templates, spelled from the schema's field names once at import (%% survive as % fields).
# Timestamps and durations are formatted from integer nanoseconds: exact µs, cheaper than float repr.
_TS = '{"%s":%d,"%s":%%d.%%06d' % (S.V, S.SCHEMA_VERSION, S.TS)
_START_LINE = _TS + '%%s%%s,"%s":%%d%%s%%s}\n' % S.SEQ
_END_LINE = _TS + '%%s%%s,"%s":%%d,"%s":%%d.%%03d%%s%%s}\n' % (S.SEQ, S.DUR_MS)
_POINT_LINE = _TS + '%%s%%s%%s%%s,"%s":%%d,"%s":%%d%%s%%s}\n' % (S.TID, S.SEQ)
_BODY = '%%s,"%s":"%%016x"%%s%%s,"%s":%%d' % (S.SPAN_ID, S.TID)
_BODY_WITH_PARENT = '%%s,"%s":"%%016x","%s":"%%016x"%%s%%s,"%s":%%d' % (S.SPAN_ID, S.PARENT_SPAN_ID, S.TID)
_POINT_IDS = ',"%s":"%%032x","%s":"%%016x"' % (S.TRACE_ID, S.SPAN_ID)
_OK = ',"%s":"%s"' % (S.STATUS, S.STATUS_OK)
_ERROR = ',"%s":"%s"' % (S.STATUS, S.STATUS_ERROR)
_INCOMPLETE = ',"%s":"%s"' % (S.STATUS, S.STATUS_INCOMPLETE)


def step_context_attrs(state: StepState) -> dict[str, Any]:
    """The ``training.*`` attributes the runtime copies from a span's step context for sinks other than
    JSONL (OTLP, console, handlers), as the SDK holds them (sequences as tuples)."""
    out: dict[str, Any] = {}
    if state.step is not None:
        out[S.ATTR_STEP] = state.step
        out[S.ATTR_RELATIVE_STEP] = state.relative_step
    if state.epoch is not None:
        out[S.ATTR_EPOCH] = state.epoch
    if state.iteration is not None:
        out[S.ATTR_ITERATION] = state.iteration
    if state.tags:
        out[S.ATTR_TAGS] = tuple(clean_text(tag) for tag in state.tags)
    return out


def _error_of(span: Any) -> dict[str, str]:
    for event in reversed(span.events):
        if event.name == "exception":
            attrs = event.attributes
            return {"type": str(attrs.get("exception.type", "")), "message": str(attrs.get("exception.message", ""))}
    return {"type": "", "message": span.status.description or ""}
