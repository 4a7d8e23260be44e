"""OTLP/JSON: a run as one ``ExportTraceServiceRequest`` in JSON (Jaeger UI: Search, Upload JSON).

The spans are the SDK spans ``otel-train push`` sends (:mod:`otel_train.analysis.otlp`), encoded by the
SDK's own encoder (``encode_spans``) and protobuf's ``json_format``: camelCase keys, integer enums,
64-bit integers as strings. Protobuf JSON writes bytes as base64; OTLP/JSON wants trace and span ids
in hex, so those fields are rewritten. One ``resourceSpans`` entry per process, written one process at
a time and its spans in chunks, so neither a big run nor a big process is held as JSON in memory.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import IO, Any

import msgspec
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan

from otel_train.analysis.export.layout import Counts
from otel_train.analysis.otlp import Tally, base_resource, process_resource, process_spans
from otel_train.analysis.spans import ProcessState

CHUNK_SPANS = 2048
"""Spans encoded at a time."""

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def write(processes: Iterable[ProcessState], f: IO[bytes], *, resource: Resource | None = None) -> Counts:
    """Write ``processes`` (finished ``keep=True`` states) to ``f`` as OTLP/JSON.

    ``resource`` is what each process's resource starts from (default: :func:`base_resource`).
    Counts: slices are spans, instants the instants written as span events; processes without a
    span are left out.
    """
    base = resource if resource is not None else base_resource()
    tally = Tally()
    f.write(b'{"resourceSpans":[')
    for state in processes:
        spans = process_spans(state, process_resource(state, base), tally)
        if _write_process(spans, f, first=tally.processes == 0):
            tally.processes += 1
    f.write(b"]}\n")
    return Counts(tally.spans, tally.events, 0, tally.processes)


def _write_process(spans: Iterator[ReadableSpan], f: IO[bytes], *, first: bool) -> bool:
    """One process's ``resourceSpans`` entry; False (nothing written) when it has no span."""
    chunk = list(islice(spans, CHUNK_SPANS))
    if not chunk:
        return False
    (resource_spans,) = encode_spans(chunk).resource_spans
    (scope_spans,) = resource_spans.scope_spans
    f.write(b"" if first else b",\n")
    f.write(_open(resource_spans, "scope_spans", "scopeSpans") + _open(scope_spans, "spans", "spans"))
    sep = b""
    while True:
        for span in scope_spans.spans:
            f.write(sep + msgspec.json.encode(hex_ids(json_format.MessageToDict(span, use_integers_for_enums=True))))
            sep = b","
        chunk = list(islice(spans, CHUNK_SPANS))
        if not chunk:
            break
        scope_spans = encode_spans(chunk).resource_spans[0].scope_spans[0]
    f.write(b"]}]}")
    return True


def _open(message: Any, field: str, key: str) -> bytes:
    """``message`` as JSON without ``field``, left open at ``"key":[`` for its items to follow."""
    head = type(message)()
    head.CopyFrom(message)
    head.ClearField(field)
    text = msgspec.json.encode(json_format.MessageToDict(head, use_integers_for_enums=True))[:-1]
    return text + (b"," if len(text) > 1 else b"") + b'"' + key.encode() + b'":['


def hex_ids(span: dict) -> dict:
    """A span's (and its links') ids from protobuf JSON's base64 to OTLP/JSON's hex."""
    for item in (span, *span.get("links", ())):
        for key in _ID_FIELDS:
            value = item.get(key)
            if value:
                item[key] = base64.b64decode(value).hex()
    return span
