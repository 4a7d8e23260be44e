"""Build the non-JSONL span processors named by ``OTEL_TRACES_EXPORTER`` from the standard OTel env.

The SDK's own exporters read ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, timeout, compression,
certificates) exactly as the SDK documents; this module only picks which exporter to build and
which sampler thins what it sends. Construction problems raise ``ConfigError`` (``init`` is strict).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any
from contextlib import contextmanager
from urllib import parse

from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_TRACES_SAMPLER,
    OTEL_TRACES_SAMPLER_ARG,
)
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import Sampler

from otel_train._otlp_partial import count_rejections
from otel_train.errors import ConfigError
from otel_train.exporters.otlp.processor import BoundedBatchSpanProcessor
from otel_train.redact import REDACTED, RedactingFilter, strip_userinfo

OTLP = "otlp"
CONSOLE = "console"
EXPORTER_NAMES = (OTLP, CONSOLE)

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)
# opentelemetry-sdk 1.45 maps a bare "otlp" exporter with no protocol set to its gRPC exporter.
DEFAULT_PROTOCOL = PROTOCOL_GRPC

_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
# With no parent context these keep every span: skip the per-span call.
_KEEP_ALL_SAMPLERS = ("always_on", "parentbased_always_on")

# Variables the SDK's OTLP exporters read from os.environ while they are constructed.
_EXPORTER_ENV_PREFIXES = ("OTEL_EXPORTER_OTLP_", "OTEL_PYTHON_EXPORTER_OTLP_", "_OTEL_PYTHON_EXPORTER_OTLP_")
_ENVIRON_LOCK = threading.Lock()
_HEADER_VARS = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# The SDK loggers that print the endpoint (gRPC: "... exporting traces to user:pw@host") or a header
# that failed to parse (util.re); a filter on each rewrites their records before any handler sees them.
_SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.util.re",
)
_SDK_LOG_FILTER = RedactingFilter()


def otlp_protocol(env: Mapping[str, str]) -> str:
    """The OTLP trace protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
    for key in (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL):
        raw = env.get(key, "").strip()
        if raw:
            if raw not in PROTOCOLS:
                raise ConfigError(f"{key}={raw!r} is not supported; use one of {', '.join(PROTOCOLS)}.")
            return raw
    return DEFAULT_PROTOCOL


def sampler_from_env(env: Mapping[str, str]) -> Sampler | None:
    """The sampler named by ``OTEL_TRACES_SAMPLER``/``_ARG`` (SDK names and entry points); None keeps all.

    Strict where the SDK only warns: an unknown name or a bad ratio raises ``ConfigError``.
    """
    name = env.get(OTEL_TRACES_SAMPLER, "").strip().lower()
    if not name or name in _KEEP_ALL_SAMPLERS:
        return None
    # Imported here: the SDK's configuration module scans entry points, which only init needs.
    from opentelemetry.sdk._configuration import _import_sampler_factory

    raw_arg = env.get(OTEL_TRACES_SAMPLER_ARG)
    try:
        factory = _import_sampler_factory(name)
    except Exception:  # noqa: BLE001 - the SDK raises RuntimeError for an unknown name
        raise ConfigError(
            f"{OTEL_TRACES_SAMPLER}={name!r} is not a known sampler; use always_on, always_off, traceidratio, "
            "parentbased_traceidratio, parentbased_always_on, parentbased_always_off or a registered one."
        ) from None
    arg: float | str | None = raw_arg
    if name in _RATIO_SAMPLERS:
        # The SDK's default when no ratio is given.
        arg = 1.0 if raw_arg is None or not raw_arg.strip() else _ratio(raw_arg)
    try:
        sampler = factory(arg)
    except Exception as exc:  # noqa: BLE001 - any factory failure is a configuration problem
        raise ConfigError(f"{OTEL_TRACES_SAMPLER}={name!r} with {OTEL_TRACES_SAMPLER_ARG}={raw_arg!r}: {exc}") from None
    if not isinstance(sampler, Sampler):
        raise ConfigError(f"{OTEL_TRACES_SAMPLER}={name!r} did not produce a Sampler; check the sampler entry point.")
    return sampler


def _ratio(raw: str) -> float:
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"{OTEL_TRACES_SAMPLER_ARG}={raw!r} must be a number from 0 to 1 for a ratio sampler.")
    return ratio


@contextmanager
def _exporter_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Show the SDK exporters ``env``'s OTLP variables while they read os.environ in ``__init__``."""
    if env is os.environ:
        yield
        return
    with _ENVIRON_LOCK:
        saved = {k: v for k, v in os.environ.items() if k.startswith(_EXPORTER_ENV_PREFIXES)}
        for key in saved:
            del os.environ[key]
        mine = {k: v for k, v in env.items() if k.startswith(_EXPORTER_ENV_PREFIXES)}
        os.environ.update(mine)
        try:
            yield
        finally:
            for key in mine:
                os.environ.pop(key, None)
            os.environ.update(saved)


def _secrets(env: Mapping[str, str]) -> set[str]:
    """What must never be printed: every OTLP header's value (and whole entry), and the endpoints'
    ``user:password@`` (the gRPC exporter logs the endpoint without its scheme)."""
    secrets: set[str] = set()
    for key in _ENDPOINT_VARS:
        try:
            url = parse.urlsplit(env.get(key, "").strip())
        except ValueError:
            continue
        if url.password:
            secrets.update({url.password, parse.unquote(url.password)})
        if "@" in url.netloc:
            secrets.add(url.netloc.rpartition("@")[0] + "@")
    for key in _HEADER_VARS:
        raw = env.get(key, "")
        for entry in raw.split(","):
            name, _, value = entry.partition("=")
            for text in (entry.strip(), value.strip(), parse.unquote(value).strip()):
                if len(text) >= 4:  # shorter fragments would blank out ordinary words
                    secrets.add(text)
    return secrets


def _scrubbed(text: str, env: Mapping[str, str]) -> str:
    text = strip_userinfo(text)
    for secret in _secrets(env):
        text = text.replace(secret, REDACTED)
    return text


def _guard_sdk_logs(env: Mapping[str, str]) -> None:
    """Make the SDK loggers that may print the endpoint or headers redact them (see otel_train.redact)."""
    _SDK_LOG_FILTER.secrets |= _secrets(env)
    for name in _SDK_LOGGERS:
        logger = logging.getLogger(name)
        if _SDK_LOG_FILTER not in logger.filters:
            logger.addFilter(_SDK_LOG_FILTER)


class CollectorRedirectRefusal:
    """A response hook for the HTTP exporter's ``requests`` session: a redirect is not delivery.

    The SDK counts every status below 400 as success, and it does not follow redirects, so a collector
    (or a proxy in front of it) answering ``301``/``302``/``307``/``308`` stores nothing while the export
    "succeeds". The hook turns such an answer into a failed export (the SDK catches what it raises);
    :meth:`take` says why, once, for the processor's one-line report.
    """

    def __init__(self) -> None:
        self.last: str | None = None

    def __call__(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        status = getattr(response, "status_code", 200)
        if 300 <= status < 400:
            self.last = (f"the collector answered {status} {getattr(response, 'reason', '') or ''}".rstrip()
                         + " (a redirect: OTLP exports are not redirected, nothing was stored)")
            raise NotDelivered(self.last)
        return response

    def take(self) -> str | None:
        last, self.last = self.last, None
        return last


class NotDelivered(Exception):
    """An OTLP/HTTP answer that is not a success status."""


def refuse_redirects(exporter: SpanExporter) -> CollectorRedirectRefusal | None:
    """Install a :class:`CollectorRedirectRefusal` on an SDK OTLP/HTTP exporter's session; None when it has none."""
    client = getattr(exporter, "_client", None)
    session = getattr(getattr(client, "_transport", None), "_session", None)
    hooks = getattr(session, "hooks", None)
    if not isinstance(hooks, dict):
        return None
    guard = CollectorRedirectRefusal()
    hooks.setdefault("response", []).append(guard)
    return guard


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    _guard_sdk_logs(env)
    protocol = otlp_protocol(env)
    try:
        with _exporter_environ(env):
            if protocol == PROTOCOL_GRPC:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()
            if protocol == PROTOCOL_HTTP:
                guard = refuse_redirects(exporter)
                if guard is not None:
                    exporter._otel_train_explain = guard.take  # type: ignore[attr-defined]
            rejections = count_rejections(exporter)  # partial_success: rejected spans count as dropped
            if rejections is not None:
                exporter._otel_train_rejections = rejections.take  # type: ignore[attr-defined]
            return exporter
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any construction failure is a configuration problem
        # The message may quote the endpoint (with its user:password@) or a header: never print those.
        raise ConfigError(
            f"cannot build the OTLP {protocol} exporter: {type(exc).__name__}: {_scrubbed(str(exc), env)}. "
            "Fix the OTEL_EXPORTER_OTLP_* settings."
        ) from None


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == OTLP:
        return _otlp_exporter(env)
    if name == CONSOLE:
        return ConsoleSpanExporter()
    raise ConfigError(
        f"OTEL_TRACES_EXPORTER entry {name!r} is not supported here; use jsonl, {', '.join(EXPORTER_NAMES)} or none."
    )


def build_span_processors(
    names: tuple[str, ...], *, env: Mapping[str, str] | None = None
) -> list[BoundedBatchSpanProcessor]:
    """One ``BoundedBatchSpanProcessor`` per exporter name (``"otlp"``, ``"console"``), sampler applied.

    ``env`` defaults to ``os.environ``; ``OTEL_BSP_*`` size the batching and ``OTEL_TRACES_SAMPLER*``
    thin what these processors send (the JSONL file is not affected). Raises ``ConfigError``.
    """
    env = os.environ if env is None else env
    sampler = sampler_from_env(env)
    processors: list[BoundedBatchSpanProcessor] = []
    try:
        for name in dict.fromkeys(n.strip().lower() for n in names):
            exporter = _exporter(name, env)
            try:
                processors.append(BoundedBatchSpanProcessor(exporter, sampler=sampler, env=env))
            except ConfigError:
                exporter.shutdown()
                raise
    except ConfigError:
        for built in processors:
            built.shutdown(timeout_s=0.5)
        raise
    return processors
