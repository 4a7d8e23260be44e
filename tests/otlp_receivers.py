"""Real OTLP trace receivers on loopback, for tests.

``GrpcOtlpReceiver`` (a ``TraceServiceServicer`` on ``grpc.server``) and ``HttpOtlpReceiver``
(``POST /v1/traces``, protobuf, gzip/deflate bodies) record every span they receive as a flat dict::

    {"name", "trace_id", "span_id", "parent_span_id" (hex or None), "start_time_unix_nano",
     "end_time_unix_nano", "attributes" (dict), "resource" (dict), "status_code" (int: 0 unset,
     1 ok, 2 error), "status_message", "events" ([{"name", "time_unix_nano", "attributes"}])}

Both take ``tls=(key, cert)`` (files; ``self_signed_cert(dir)`` makes them) to serve ``https://`` only.

``BlackHoleServer`` accepts TCP connections and never answers (a collector that hangs);
``refused_endpoint()`` names a loopback port nobody listens on. All bind 127.0.0.1 only. Usage::

    with GrpcOtlpReceiver() as rx:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.endpoint
        ...
        spans = rx.wait_for(3)
"""

from __future__ import annotations

import gzip
import selectors
import shutil
import socket
import ssl
import subprocess
import threading
import zlib
from pathlib import Path
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Iterable
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

LOOPBACK = "127.0.0.1"
TRACES_PATH = "/v1/traces"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """The spans of an ``ExportTraceServiceRequest`` as flat dicts (see the module docstring)."""
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex() or None,
                        "start_time_unix_nano": span.start_time_unix_nano,
                        "end_time_unix_nano": span.end_time_unix_nano,
                        "attributes": _attributes(span.attributes),
                        "resource": resource,
                        "status_code": span.status.code,
                        "status_message": span.status.message,
                        "events": [{"name": e.name, "time_unix_nano": e.time_unix_nano,
                                    "attributes": _attributes(e.attributes)} for e in span.events],
                        "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
                                   "attributes": _attributes(link.attributes)} for link in span.links],
                    }
                )
    return out


def trace_sizes(request: trace_service_pb2.ExportTraceServiceRequest) -> dict[str, int]:
    """Encoded bytes each trace id takes in ``request``: its spans, plus its resource and scope once per
    batch that holds them (what a backend stores for the trace, as Tempo's ``max_bytes_per_trace`` counts)."""
    out: dict[str, int] = {}
    for resource_spans in request.resource_spans:
        resource = resource_spans.resource.ByteSize()
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.ByteSize()
            seen: set[str] = set()
            for span in scope_spans.spans:
                trace = span.trace_id.hex()
                extra = 0 if trace in seen else resource + scope
                seen.add(trace)
                out[trace] = out.get(trace, 0) + span.ByteSize() + extra
    return out


class _Receiver:
    """What both receivers share: the received spans, request headers and bytes per trace, and waiting
    for them."""

    endpoint: str

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._spans: list[dict[str, Any]] = []
        self._headers: list[dict[str, str]] = []
        self._trace_bytes: dict[str, int] = {}
        self.reject: str | None = None
        """Set to a message: every answer is a success that rejects every span of its request
        (``partial_success.rejected_spans``, ``error_message``), as a backend that drops what it cannot store."""

    def reply(self, request: trace_service_pb2.ExportTraceServiceRequest) -> trace_service_pb2.ExportTraceServiceResponse:
        """The answer to ``request``: empty (all accepted), or its spans rejected when :attr:`reject` is set."""
        answer = trace_service_pb2.ExportTraceServiceResponse()
        if self.reject is not None:
            answer.partial_success.rejected_spans = sum(len(s.spans) for r in request.resource_spans
                                                        for s in r.scope_spans)
            answer.partial_success.error_message = self.reject
        return answer

    def _record(self, request: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        spans, sizes = flatten(request), trace_sizes(request)
        with self._cond:
            for trace, size in sizes.items():
                self._trace_bytes[trace] = self._trace_bytes.get(trace, 0) + size
            self._spans.extend(spans)
            self._headers.append(headers)
            self._cond.notify_all()

    def spans(self) -> list[dict[str, Any]]:
        """Every span received so far, in arrival order."""
        with self._cond:
            return list(self._spans)

    def headers(self) -> list[dict[str, str]]:
        """The headers (gRPC metadata) of each export request received, keys lower-cased."""
        with self._cond:
            return list(self._headers)

    def trace_bytes(self) -> dict[str, int]:
        """Encoded bytes received so far per trace id (:func:`trace_sizes`, summed over requests)."""
        with self._cond:
            return dict(self._trace_bytes)

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Block until at least ``n`` spans arrived, then return them all; ``TimeoutError`` otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._spans) >= n, timeout):
                raise TimeoutError(f"{type(self).__name__}: expected {n} spans within {timeout}s, got {len(self._spans)}")
            return list(self._spans)

    def start(self) -> _Receiver:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> _Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: GrpcOtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        headers = {key.lower(): value for key, value in context.invocation_metadata() if isinstance(value, str)}
        self._receiver._record(request, headers)
        return self._receiver.reply(request)


class GrpcOtlpReceiver(_Receiver):
    """An OTLP/gRPC trace receiver on ``127.0.0.1:<free port>``; ``endpoint`` is ``http://127.0.0.1:PORT``
    (``https://`` with ``tls``)."""

    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        if tls is None:
            port = self._server.add_insecure_port(f"{LOOPBACK}:0")
        else:
            key, cert = (p.read_bytes() for p in tls)
            port = self._server.add_secure_port(f"{LOOPBACK}:0", grpc.ssl_server_credentials([(key, cert)]))
        self.endpoint = f"{'https' if tls else 'http'}://{LOOPBACK}:{port}"

    def start(self) -> GrpcOtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)


class _HttpHandler(BaseHTTPRequestHandler):
    server: _HttpServer

    def do_POST(self) -> None:  # noqa: N802 - the http.server hook name
        if self.path != TRACES_PATH:
            self.send_error(404, f"only {TRACES_PATH} is served")
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        encoding = self.headers.get("Content-Encoding", "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        request = trace_service_pb2.ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception:  # noqa: BLE001 - a malformed body is the client's error
            self.send_error(400, "body is not an ExportTraceServiceRequest")
            return
        self.server.receiver._record(request, {k.lower(): v for k, v in self.headers.items()})
        reply = self.server.receiver.reply(request).SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base signature
        """Keep test output quiet."""


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    receiver: HttpOtlpReceiver


class HttpOtlpReceiver(_Receiver):
    """An OTLP/HTTP (protobuf) trace receiver on ``127.0.0.1:<free port>``, serving ``POST /v1/traces``.

    ``endpoint`` is the base URL (``http://127.0.0.1:PORT``) for ``OTEL_EXPORTER_OTLP_ENDPOINT``;
    ``traces_url`` is the full URL for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``.
    """

    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        super().__init__()
        self._server = _HttpServer((LOOPBACK, 0), _HttpHandler)
        self._server.receiver = self
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile=tls[1], keyfile=tls[0])
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.endpoint = f"{'https' if tls else 'http'}://{LOOPBACK}:{self._server.server_address[1]}"
        self.traces_url = self.endpoint + TRACES_PATH
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http-receiver", daemon=True)

    def start(self) -> HttpOtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class BlackHoleServer:
    """Accepts TCP connections on ``127.0.0.1:<free port>``, reads and discards, never answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.setblocking(False)
        self.endpoint = f"http://{LOOPBACK}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="otlp-black-hole", daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                sock = key.fileobj
                if sock is self._listener:
                    conn, _ = self._listener.accept()
                    conn.setblocking(False)
                    self._selector.register(conn, selectors.EVENT_READ)
                elif not self._discard(sock):
                    self._selector.unregister(sock)
                    sock.close()

    @staticmethod
    def _discard(sock: socket.socket) -> bool:
        """Read and drop what arrived; False once the peer has gone."""
        try:
            return bool(sock.recv(65536))
        except BlockingIOError:
            return True
        except OSError:
            return False

    def start(self) -> BlackHoleServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    def __enter__(self) -> BlackHoleServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def self_signed_cert(directory: Path) -> tuple[Path, Path] | None:
    """``(key.pem, cert.pem)``: a self-signed certificate for localhost and 127.0.0.1 (None without openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert


def refused_endpoint() -> str:
    """``http://127.0.0.1:PORT`` for a port that was just free: connecting is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port = sock.getsockname()[1]
    return f"http://{LOOPBACK}:{port}"
