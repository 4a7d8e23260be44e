"""Custom handler factories (``OTEL_TRAIN_HANDLERS`` / the ``handlers`` setting).

A factory is a callable named ``module:function`` (or ``module.function``), or passed directly. It is
called once at ``init`` with the run context as keyword arguments (only those its signature accepts,
unless it takes ``**kwargs``) and returns one of:

- a ``SpanProcessor``: added to the tracer provider after the JSONL sink;
- a ``SpanExporter``: batched off the training thread like OTLP;
- a record handler: an object with ``on_record(record: dict)`` (and optionally ``shutdown()``), which
  receives every schema-v1 record (span start/end, instants, scalars) as it is written;
- ``None``: the factory attached what it needed itself (e.g. through ``tracer_provider``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

from otel_train.errors import ConfigError


@dataclass
class LoadedHandlers:
    """What the factories produced, sorted by role."""

    processors: list[SpanProcessor] = field(default_factory=list)
    exporters: list[SpanExporter] = field(default_factory=list)
    record_handlers: list[Any] = field(default_factory=list)


def resolve_factory(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """Import ``module:function`` or ``module.function``; ConfigError with a fix hint when it fails."""
    if callable(spec):
        return spec
    text = spec.strip()
    if ":" in text:
        module_name, _, attr = text.partition(":")
    else:
        module_name, _, attr = text.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"handler factory {spec!r} (OTEL_TRAIN_HANDLERS / handlers): expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"handler factory {spec!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {exc}); check the name and that it is installed") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"handler factory {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def load_handlers(specs: tuple[Any, ...], run_kwargs: Mapping[str, Any]) -> LoadedHandlers:
    """Call every factory with the run context; a failing factory raises ConfigError naming it."""
    loaded = LoadedHandlers()
    for spec in specs:
        factory = resolve_factory(spec)
        name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
        try:
            result = factory(**_accepted_kwargs(factory, run_kwargs))
        except Exception as exc:
            raise ConfigError(f"handler factory {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if result is None:
            continue
        if isinstance(result, SpanProcessor):
            loaded.processors.append(result)
        elif isinstance(result, SpanExporter):
            loaded.exporters.append(result)
        elif callable(getattr(result, "on_record", None)):
            loaded.record_handlers.append(result)
        else:
            raise ConfigError(f"handler factory {name!r} returned {type(result).__name__}; expected a "
                              "SpanProcessor, a SpanExporter, an object with on_record(record), or None")
    return loaded


def _accepted_kwargs(factory: Callable[..., Any], run_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return dict(run_kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(run_kwargs)
    names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in run_kwargs.items() if k in names}
