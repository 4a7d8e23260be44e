"""Where pushed spans go: the OTel SDK's ``OTLPSpanExporter``, its failures told in one line without secrets.

The SDK exporters do all the network work, as they do for live spans: gRPC or HTTP/protobuf, TLS,
compression, headers, timeouts and retries, with every ``OTEL_EXPORTER_OTLP_*`` (and ``_TRACES_``)
variable read by the SDK itself. What is given here wins over the variables: an endpoint, a
protocol, headers (added to the variables' headers), a timeout (one export, retries included).

An endpoint's ``user:password@`` becomes a ``Basic`` authorization header and leaves the URL, so it
is never part of a message. The exporters report a failure by returning FAILURE and logging why;
:class:`Destination` catches those log records (they would otherwise print, several lines each) and
raises :class:`PushError` with the reason on one line that names the endpoint and no header value.
A success that rejects spans (OTLP ``partial_success``: :mod:`otel_train._otlp_partial`) is counted
and returned by :meth:`Destination.send`. docs/otlp.md ("Pushing trace files") has the details.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_HEADERS,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_HEADERS,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from otel_train._otlp_partial import count_rejections

GRPC, HTTP = "grpc", "http/protobuf"
PROTOCOLS = (GRPC, HTTP)
TRACES_PATH = "/v1/traces"
AUTHORIZATION = "authorization"
_SDK_LOGGER = "opentelemetry"
_HEADER_PARSER_LOGGER = "opentelemetry.util.re"  # logs the text of a malformed header: never shown
_USERINFO = re.compile(r"(?<=//)[^/@\s]*@")
_GRACE_S = 0.5
"""What a request may take past its timeout before it is abandoned (the SDK's own deadline comes first)."""
_MIN_SECRET_LEN = 4  # shorter header values are not scrubbed from messages (they would mangle words)


class PushError(Exception):
    """The spans could not be sent; one line naming the endpoint, never a header value or password."""


def redact_url(url: str) -> str:
    """``url`` without its ``user:password@`` part."""
    return _USERINFO.sub("", url)


@contextmanager
def sdk_log(name: str = _SDK_LOGGER) -> Iterator[list[logging.LogRecord]]:
    """Collect (instead of print) what the SDK logs under ``name`` meanwhile."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger(name), Keep(logging.WARNING)
    # The SDK's exporter loggers drop a message equal to the one before (a DuplicateFilter): a second
    # failing push in this process would lose its reason. Everything is collected here, so lift them.
    filtered = [lg for key, lg in logging.Logger.manager.loggerDict.items()
                if isinstance(lg, logging.Logger) and lg.filters and (key + ".").startswith(name + ".")]
    saved = [(lg, lg.filters) for lg in filtered]
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    for lg in filtered:
        lg.filters = []
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        for lg, filters in saved:
            lg.filters = filters


def parse_headers(values: Iterable[str], what: str = "--header") -> dict[str, str]:
    """``KEY=VALUE`` strings, each possibly a comma-separated list, read by the SDK's own header parser.

    Raises PushError naming the position of a malformed one, never its text (it may be a secret).
    """
    out: dict[str, str] = {}
    for i, value in enumerate(values, 1):
        with sdk_log(_HEADER_PARSER_LOGGER) as complaints:
            parsed = parse_env_headers(value, liberal=True)
        if complaints or (value.strip() and not parsed):
            raise PushError(f"{what} #{i}: expected KEY=VALUE[,KEY=VALUE...] (text not shown: it may be a secret)")
        out.update(parsed)
    return out


def env_headers() -> dict[str, str]:
    """The headers ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` (else ``OTEL_EXPORTER_OTLP_HEADERS``) give the SDK."""
    for name in (OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_EXPORTER_OTLP_HEADERS):
        if os.environ.get(name):
            return parse_headers([os.environ[name]], name)
    return {}


def resolve_protocol(protocol: str | None) -> str:
    """``protocol``, else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``, else grpc."""
    source = "--protocol"
    if not protocol:
        for source in (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL):
            protocol = os.environ.get(source, "").strip()
            if protocol:
                break
    value = (protocol or GRPC).strip().lower()
    if value not in PROTOCOLS:
        raise PushError(f"{source} {value!r}: use one of {', '.join(PROTOCOLS)}")
    return value


def split_userinfo(endpoint: str) -> tuple[str, str | None, str | None]:
    """``endpoint`` without ``user:password@``, the ``Basic`` authorization it stood for, and the password."""
    bare = "://" not in endpoint  # gRPC endpoints are often host:port
    parts = urlsplit("//" + endpoint if bare else endpoint)
    if "@" not in parts.netloc:
        return endpoint, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    url = urlunsplit(parts._replace(netloc=host))
    return (url[2:] if bare else url), f"Basic {token}", password or None


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL (as in ``OTEL_EXPORTER_OTLP_ENDPOINT``) with ``/v1/traces``; kept when it has it."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PushError(f"{redact_url(endpoint)}: an OTLP/HTTP endpoint is an http(s) URL, e.g. http://127.0.0.1:4318")
    path = parts.path.rstrip("/")
    return urlunsplit(parts._replace(path=path if path.endswith(TRACES_PATH) else path + TRACES_PATH))


class Redirected(Exception):
    """An OTLP/HTTP answer in the 3xx range: the SDK counts it a success, but nothing was stored."""


class RedirectRefusal:
    """A response hook on the HTTP exporter's ``requests`` session: a redirect fails the export.

    The SDK takes every status below 400 as delivery and follows no redirect, so an endpoint answering
    ``301`` (a proxy, a moved collector) stores nothing while the push "succeeds". What this raises the
    SDK catches (a failed export); :meth:`take` gives the reason for the one error line.
    """

    def __init__(self) -> None:
        self.last: str | None = None

    def __call__(self, response: object, *args: object, **kwargs: object) -> object:
        status = getattr(response, "status_code", 200)
        if 300 <= status < 400:
            reason = getattr(response, "reason", "") or ""
            self.last = (f"the endpoint answered {status} {reason}".rstrip()
                         + " (a redirect: OTLP exports are not redirected, nothing was stored)")
            raise Redirected(self.last)
        return response

    def take(self) -> str | None:
        last, self.last = self.last, None
        return last


def refuse_redirects(exporter: SpanExporter) -> RedirectRefusal | None:
    """Hook a :class:`RedirectRefusal` into an SDK OTLP/HTTP exporter's session (None for gRPC)."""
    session = getattr(getattr(getattr(exporter, "_client", None), "_transport", None), "_session", None)
    hooks = getattr(session, "hooks", None)
    if not isinstance(hooks, dict):
        return None
    refusal = RedirectRefusal()
    hooks.setdefault("response", []).append(refusal)
    return refusal


class Destination:
    """An SDK span exporter that raises :class:`PushError` (one line, secrets scrubbed) when an export fails.

    ``shown`` names the endpoint in messages; ``secrets`` are scrubbed from them; ``warnings`` holds
    what the SDK said while the exporter was built (e.g. an unsupported compression), scrubbed.
    """

    def __init__(self, exporter: SpanExporter, shown: str, secrets: Iterable[str] = (),
                 warnings: Sequence[str] = (), timeout_s: float | None = None) -> None:
        self.exporter = exporter
        self.shown = shown
        self.timeout_s = timeout_s
        """The bound of one :meth:`send`, connect, every read and the SDK's retries together (None: none);
        it waits ``_GRACE_S`` more, so an export that ends by the SDK's own deadline says why itself."""
        self._abandoned = False
        self._secrets = sorted({s for s in secrets if len(s) >= _MIN_SECRET_LEN}, key=len, reverse=True)
        self.warnings = [self.scrub(w) for w in warnings]
        self.refusal = refuse_redirects(exporter)
        self.rejections = count_rejections(exporter)
        """Spans the endpoint answered success for and rejected (OTLP ``partial_success``)."""

    def scrub(self, text: str) -> str:
        """``text`` on one line, without URL passwords or header values."""
        text = redact_url(" ".join(text.split()))
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def send(self, spans: Sequence[ReadableSpan]) -> tuple[int, str]:
        """Export ``spans``: (how many the endpoint rejected in a successful answer, its message, scrubbed);
        raises PushError when the exporter (after its own retries) gives up, or when the whole request
        has not finished within ``timeout_s``."""
        with sdk_log() as records:
            bound = None if self.timeout_s is None else self.timeout_s + _GRACE_S
            outcome = _within(bound, self.exporter.export, spans)
        if outcome is None:
            self._abandoned = True
            raise PushError(self.scrub(
                f"cannot push to {self.shown}: no complete answer within the {self.timeout_s:g} s timeout (it bounds "
                "the whole request: connecting, every read and the retries); the request was abandoned"))
        result, exc = outcome
        if exc is not None:  # an exporter bug or a bad value becomes the one line
            raise PushError(self.scrub(f"cannot push to {self.shown}: {type(exc).__name__}: {exc}")) from None
        if result is not SpanExportResult.SUCCESS:
            why = self.refusal.take() if self.refusal is not None else None
            raise PushError(self.scrub(f"cannot push to {self.shown}: {why or failure_reason(records)}"))
        rejected, message = self.rejections.take() if self.rejections is not None else (0, "")
        return rejected, self.scrub(message)

    def close(self) -> None:
        """Shut the exporter down (closes its channel or session); after an abandoned request, waits at
        most a second for that (the stalled read may hold the session)."""
        with sdk_log():
            _within(1.0 if self._abandoned else None, self.exporter.shutdown)


def _within(bound_s: float | None, call: Any, *args: Any) -> tuple[Any, BaseException | None] | None:
    """(result, None) or (None, the exception) of ``call(*args)``, or None when it has not returned within
    ``bound_s`` seconds: it then goes on in a daemon thread that nothing waits for (the SDK's HTTP client
    bounds each socket read, not the response, so a peer that trickles bytes holds it indefinitely)."""
    if bound_s is None:
        try:
            return call(*args), None
        except Exception as exc:  # noqa: BLE001 - the caller turns it into the one line
            return None, exc
    box: list[tuple[Any, BaseException | None]] = []

    def run() -> None:
        try:
            box.append((call(*args), None))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            box.append((None, exc))

    worker = threading.Thread(target=run, name="otel-train-push", daemon=True)
    worker.start()
    worker.join(bound_s)
    return box[0] if box else None


def export_timeout(timeout_s: float | None) -> float:
    """The bound of one export: ``timeout_s``, else ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``, else
    ``OTEL_EXPORTER_OTLP_TIMEOUT`` (seconds, as the Python SDK reads them), else 10."""
    if timeout_s is not None:
        return timeout_s
    for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        try:
            value = float(os.environ.get(name, "") or "nan")
        except ValueError:
            continue
        if value > 0:
            return value
    return 10.0


def failure_reason(records: Sequence[logging.LogRecord]) -> str:
    """Why an export failed, from what the SDK exporter logged: its last error, and the last retry's cause
    when the error alone does not say (the HTTP exporter's "timeout, max retries or shutdown")."""
    errors = [r for r in records if r.levelno >= logging.ERROR]
    retries = [r for r in records if r.levelno == logging.WARNING]
    if not errors:
        return retries[-1].getMessage() if retries else "the exporter gave no reason"
    reason = errors[-1].getMessage()
    if retries and len(errors[-1].args or ()) <= 1:
        reason += f" Last retry: {retries[-1].getMessage()}"
    return reason


def open_destination(
    endpoint: str | None = None,
    protocol: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> Destination:
    """The SDK's OTLPSpanExporter for ``protocol``; what is not given comes from the OTLP variables.

    Raises PushError for a bad protocol, endpoint or header, or an exporter the SDK cannot build.
    """
    protocol = resolve_protocol(protocol)
    merged = {**env_headers(), **{k.lower(): v for k, v in (headers or {}).items()}}
    password = None
    if endpoint:
        endpoint, auth, password = split_userinfo(endpoint.strip())
        if auth is not None:
            merged.setdefault(AUTHORIZATION, auth)
        if protocol == HTTP:
            endpoint = traces_url(endpoint)
    shown = redact_url(endpoint) if endpoint else "the endpoint in OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT"
    with sdk_log() as records:
        try:
            exporter = _exporter(protocol, endpoint or None, merged or None, timeout_s)
        except Exception as exc:  # noqa: BLE001 - e.g. an unknown compression: one line, not a traceback
            raise PushError(f"{shown}: cannot set up the OTLP exporter: {type(exc).__name__}: {exc}") from None
    if not endpoint:
        shown = redact_url(str(getattr(exporter, "_endpoint", shown)))
    secrets = [*merged.values(), *([password, unquote(password)] if password else [])]
    return Destination(exporter, shown, secrets, [r.getMessage() for r in records], export_timeout(timeout_s))


def _exporter(protocol: str, endpoint: str | None, headers: dict[str, str] | None,
              timeout_s: float | None) -> SpanExporter:
    # Imported here: each pulls in its transport (grpc, requests), needed only for the one chosen.
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, headers=headers, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint, headers=headers, timeout=timeout_s)
