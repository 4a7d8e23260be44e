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
from opentelemetry.trace import StatusCode

from otel_train import schema as S
from otel_train.context import StepState

INCOMPLETE_ATTR = S.ATTR_INCOMPLETE


def _fallback(obj: Any) -> Any:
    # Attribute values JSON can't hold (numpy scalars, paths, enums...) are written as text, never dropped.
    return str(obj)


encode_json = msgspec.json.Encoder(enc_hook=_fallback).encode


def _frag(key: str, value: Any) -> str:
    """``,"key":<json value>`` — one field, ready to splice into a record."""
    return f',"{key}":{encode_json(value).decode()}'


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
        frame = sys._getframe(2)
        skip = self._skip
        while frame is not None and frame.f_code.co_filename.startswith(skip):
            frame = frame.f_back
        if frame is None:
            return ""
        code = frame.f_code
        key = (code, frame.f_lineno)
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) > 4096:  # bounded: generated code could mint endless keys
                self._cache.clear()
            found = self._cache[key] = _frag(S.CALLER, f"{code.co_filename}:{frame.f_lineno}:{code.co_name}")
        return found


class RecordEncoder:
    """Encodes span starts/ends, instants and scalars; ``static`` holds the run-context fields."""

    __slots__ = ("_static", "_heads", "_hex", "_skip_attr_prefix")

    def __init__(self, static: Mapping[str, Any], *, skip_attr_prefix: str | None = None) -> None:
        self._static = "".join(_frag(k, v) for k, v in static.items())
        self._heads: dict[tuple[str, str], str] = {}
        self._hex: tuple[int, str] = (0, "")
        self._skip_attr_prefix = skip_attr_prefix

    def _head(self, kind: str, name: str) -> str:
        """``,"kind":..,"event":..,"name":..`` for one (kind, name), cached."""
        key = (kind, name)
        head = self._heads.get(key)
        if head is None:
            if kind == S.SPAN_START:
                event = name + S.START_SUFFIX
            elif kind == S.SPAN_END:
                event = name + S.END_SUFFIX
            elif kind == S.SCALAR:
                event = S.SCALAR
            else:
                event = name
            if len(self._heads) > 4096:
                self._heads.clear()
            head = self._heads[key] = _frag(S.KIND, kind) + _frag(S.EVENT, event) + _frag(S.NAME, name)
        return head

    def ids(self, span: Any) -> str:
        """The ``trace_id``/``span_id``/``parent_span_id`` fragment of a span (reused for its end record)."""
        ctx = span.context
        trace_id = ctx.trace_id
        # Spans mostly arrive in runs of one trace: a one-entry cache saves formatting the trace id.
        last_id, trace_part = self._hex
        if last_id != trace_id:
            trace_part = ',"%s":"%032x"' % (S.TRACE_ID, trace_id)
            self._hex = (trace_id, trace_part)
        parent = span.parent
        if parent is not None:
            return '%s,"%s":"%016x","%s":"%016x"' % (trace_part, S.SPAN_ID, ctx.span_id, S.PARENT_SPAN_ID,
                                                    parent.span_id)
        return '%s,"%s":"%016x"' % (trace_part, S.SPAN_ID, ctx.span_id)

    def _point_ids(self, trace_id: int, span_id: int) -> str:
        if not span_id:
            return ""
        return ',"%s":"%032x","%s":"%016x"' % (S.TRACE_ID, trace_id, S.SPAN_ID, span_id)

    def _attrs(self, attributes: Mapping[str, Any] | None) -> str:
        if not attributes:
            return ""
        prefix = self._skip_attr_prefix
        attrs = {k: v for k, v in attributes.items()
                 if k != INCOMPLETE_ATTR and (prefix is None or not k.startswith(prefix))}
        return _frag(S.ATTRS, attrs) if attrs else ""

    def _line(self, ts: str, head: str, ids: str, state: StepState, tid: int, seq: int, tail: str) -> bytes:
        return ('{"v":%d,"ts":%s%s%s%s%s,"tid":%d,"seq":%d%s}\n' % (
            S.SCHEMA_VERSION, ts, head, ids, _step_fragment(state), self._static, tid, seq, tail)).encode()

    def span_start(self, span: Any, ids: str, state: StepState, tid: int, seq: int, caller: str) -> bytes:
        """The ``span_start`` line of an SDK span that has just started."""
        return self._line(_ts(span.start_time), self._head(S.SPAN_START, span.name), ids, state, tid, seq,
                          caller + self._attrs(span.attributes))

    def span_end(self, span: Any, ids: str, state: StepState, tid: int, seq: int) -> bytes:
        """The ``span_end`` line of an SDK span that has just ended."""
        start, end = span.start_time, span.end_time
        attributes = span.attributes
        if attributes and attributes.get(INCOMPLETE_ATTR):
            status = _INCOMPLETE
        elif span.status.status_code is StatusCode.ERROR:
            status = _ERROR + _frag(S.ERROR, _error_of(span))
        else:
            status = _OK
        return self._line(_ts(end), self._head(S.SPAN_END, span.name), ids, state, tid, seq,
                          ',"%s":%r%s%s' % (S.DUR_MS, (end - start) / 1e6, status, self._attrs(attributes)))

    def point(self, kind: str, name: str, ts_ns: int, trace_id: int, span_id: int, state: StepState, tid: int,
              seq: int, caller: str, payload_key: str, payload: Mapping[str, Any] | None) -> bytes:
        """An ``instant`` or ``scalar`` line; ids are those of the enclosing span (0 when none)."""
        body = _frag(payload_key, dict(payload)) if payload else ""
        return self._line(_ts(ts_ns), self._head(kind, name), self._point_ids(trace_id, span_id), state, tid, seq,
                          caller + body)


_OK = ',"%s":"%s"' % (S.STATUS, S.STATUS_OK)
_ERROR = ',"%s":"%s"' % (S.STATUS, S.STATUS_ERROR)
_INCOMPLETE = ',"%s":"%s"' % (S.STATUS, S.STATUS_INCOMPLETE)


def _ts(ns: int) -> str:
    # Unix seconds with exactly µs precision, from the SDK's integer nanoseconds (cheaper than float formatting).
    us = str(ns // 1000)
    return us[:-6] + "." + us[-6:]


def _error_of(span: Any) -> dict[str, str]:
    for event in reversed(span.events):
        if event.name == "exception":
            attrs = event.attributes
            return {"type": str(attrs.get("exception.type", "")), "message": str(attrs.get("exception.message", ""))}
    return {"type": "", "message": span.status.description or ""}
