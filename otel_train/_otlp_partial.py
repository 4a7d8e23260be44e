"""Spans an OTLP backend accepted the request of, and still rejected (``partial_success``).

An OTLP answer of 200 (HTTP) or OK (gRPC) may carry ``partial_success.rejected_spans`` and an
``error_message``: the backend received the request and dropped that many spans (too old, too big,
over a quota). The SDK's exporters return SUCCESS either way; :func:`count_rejections` hooks into one
so that what was rejected is counted: ``otel-train push`` reports it as a failure, the runtime's OTLP
processor as dropped (docs/otlp.md). Used by both sides, so it imports nothing of either; the
protobuf classes (the SDK's own, opentelemetry-proto) are imported when an answer is read. The SDK
does all the network work: this only reads the answer it received.

* OTLP/HTTP: a response hook on the exporter's ``requests`` session decodes a 2xx body as an
  ``ExportTraceServiceResponse`` (the encoding of the request: protobuf).
* OTLP/gRPC: the exporter's stub is wrapped so the ``Export`` call's return value is read (again
  each time the SDK makes a new channel and stub).
"""

from __future__ import annotations

import threading
from typing import Any


class Rejections:
    """What the backend rejected since the last :meth:`take`: spans and its last message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans = 0
        self._message = ""

    def note(self, answer: Any) -> None:
        """Count an ``ExportTraceServiceResponse``'s ``partial_success`` (anything else: nothing)."""
        partial = getattr(answer, "partial_success", None)
        rejected = getattr(partial, "rejected_spans", 0)
        if isinstance(rejected, int) and rejected > 0:
            with self._lock:
                self._spans += rejected
                self._message = " ".join(str(getattr(partial, "error_message", "") or "").split())[:300]

    def note_body(self, body: bytes) -> None:
        """Count the ``partial_success`` of an OTLP/HTTP answer's protobuf body (not one: nothing)."""
        if not body:
            return
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        answer = ExportTraceServiceResponse()
        try:
            answer.ParseFromString(body)
        except Exception:  # noqa: BLE001 - a body that is not an answer tells nothing of rejections
            return
        self.note(answer)

    def take(self) -> tuple[int, str]:
        """(spans rejected, the backend's last message) since the last call; resets both."""
        with self._lock:
            got = (self._spans, self._message)
            self._spans, self._message = 0, ""
            return got

    def __call__(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        """The ``requests`` response hook (OTLP/HTTP)."""
        status = getattr(response, "status_code", 0)
        if isinstance(status, int) and 200 <= status < 300:
            try:
                self.note_body(bytes(response.content or b""))
            except Exception:  # noqa: BLE001 - a hook must never fail the export it reads
                pass
        return response


class _CountingStub:
    """An OTLP/gRPC trace stub whose ``Export`` answers are counted; everything else is the real stub's."""

    def __init__(self, stub: Any, rejections: Rejections) -> None:
        self._stub = stub
        self._rejections = rejections

    def Export(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the gRPC method name
        answer = self._stub.Export(*args, **kwargs)
        self._rejections.note(answer)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


def count_rejections(exporter: Any) -> Rejections | None:
    """Hook a :class:`Rejections` into an SDK OTLP span exporter (HTTP or gRPC); None when it is neither."""
    rejections = Rejections()
    session = getattr(getattr(getattr(exporter, "_client", None), "_transport", None), "_session", None)
    hooks = getattr(session, "hooks", None)
    if isinstance(hooks, dict):  # OTLP/HTTP
        hooks.setdefault("response", []).append(rejections)
        return rejections
    reinit = getattr(exporter, "_initialize_channel_and_stub", None)
    if not callable(reinit) or getattr(exporter, "_client", None) is None:
        return None

    def initialize_again() -> None:  # the SDK makes a new channel and stub after UNAVAILABLE
        reinit()
        if exporter._client is not None and not isinstance(exporter._client, _CountingStub):
            exporter._client = _CountingStub(exporter._client, rejections)

    exporter._client = _CountingStub(exporter._client, rejections)
    exporter._initialize_channel_and_stub = initialize_again
    return rejections
