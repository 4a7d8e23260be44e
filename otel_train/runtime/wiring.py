"""The tracing pipeline one ``init`` builds: ids, tracer, processors and sinks, in the order spans meet them.

Flow: user call (``otel_train.api``) → SDK span → processors (JSONL first, then training-context
attributes, then OTLP/console/custom) → sinks. A JSONL-only run takes the lean path
(``otel_train.tracers.LeanTracer``) and builds no SDK provider. Everything here raises ``ConfigError``
or nothing.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from otel_train import _modes, _report, api
from otel_train import context as step_context
from otel_train import schema as S
from otel_train._version import __version__
from otel_train.config import Settings
from otel_train.errors import ConfigError
from otel_train.exporters.jsonl.encoder import CallerFinder, RecordEncoder, check_sdk_span_fields, step_context_attrs
from otel_train.exporters.jsonl.processor import JsonlSpanProcessor
from otel_train.exporters.jsonl.writer import RotatingFileWriter
from otel_train.exporters.otlp import BoundedBatchSpanProcessor, build_span_processors
from otel_train.handlers import load_handlers
from otel_train.redact import Redactor
from otel_train.resource import RunContext, build_resource
from otel_train.runtime.ids import StepTraceIdGenerator, step_span_starter
from otel_train.runtime.state import Runtime
from otel_train.tracers import CleanTracer, LeanTracer


class TrainingContextProcessor(SpanProcessor):
    """Copies the step context onto spans as ``training.*`` attributes, for OTLP and custom sinks; an
    attribute of that name the user gave is kept as given."""

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        given = span._attributes
        for key, value in step_context_attrs(step_context.current()).items():
            if not given or key not in given:
                span.set_attribute(key, value)


def build(rt: Runtime) -> None:
    """Fill ``rt`` with the provider (when one is needed), processors, the trace file and the tracer,
    and install the hot path's :class:`otel_train.api.Tracing`."""
    settings, ctx = rt.settings, rt.ctx
    exporters = settings.traces_exporter
    rt.ids = id_generator = StepTraceIdGenerator()
    log_dir = Path(settings.save_path or ".") / S.STRUCTURED_LOGS_DIR
    # The SDK provider is built only when something besides the JSONL sink may see spans (OTLP,
    # console, custom handlers): a JSONL-only run takes the lean path and never needs it (nor pays
    # its after-fork resource detection in every DataLoader worker).
    sdk_sinks = tuple(n for n in exporters if n != "jsonl")
    provider = None
    if sdk_sinks or settings.handlers:
        rt.provider = provider = TracerProvider(
            sampler=ALWAYS_ON,  # sampling thins OTLP only: the JSONL file keeps every span
            resource=build_resource(ctx),
            id_generator=id_generator,
            shutdown_on_exit=False,
        )
        run_kwargs = dict(
            rank=ctx.rank, local_rank=ctx.local_rank, world_size=ctx.world_size, attempt=ctx.attempt,
            job_id=ctx.job_id, run_id=ctx.run_id, source=ctx.source, host=ctx.host, pid=ctx.pid,
            save_path=settings.save_path, log_dir=str(log_dir), settings=settings, resource=provider.resource,
            tracer_provider=provider,
        )
        handlers = load_handlers(settings.handlers, run_kwargs)
        rt.record_handlers = handlers.record_handlers
        rt.batch_processors = build_span_processors(sdk_sinks)
        rt.batch_processors += [BoundedBatchSpanProcessor(exporter) for exporter in handlers.exporters]
        rt.other_processors = handlers.processors
    has_others = bool(rt.batch_processors or rt.other_processors)

    if "jsonl" in exporters:
        rt.writer = _open_writer(settings, ctx, log_dir)
        rt.file_path = rt.writer.path
    if rt.writer is not None or rt.record_handlers:
        try:
            check_sdk_span_fields()
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from None
        encoder = RecordEncoder(_static_fields(ctx), skip_context_attrs=has_others)
        rt.jsonl = JsonlSpanProcessor(
            rt.writer, encoder, caller=CallerFinder(_library_dirs()),
            record_handlers=[h.on_record for h in rt.record_handlers],
            redact=Redactor(settings.redact).record,  # every text field of every record (docs/settings.md)
        )
    if provider is not None:
        if rt.jsonl is not None:
            provider.add_span_processor(rt.jsonl)
        if has_others:
            provider.add_span_processor(TrainingContextProcessor())
        for processor in rt.other_processors + rt.batch_processors:
            provider.add_span_processor(processor)
        tracer: trace.Tracer = CleanTracer(provider.get_tracer("otel_train", __version__))
    else:
        # Nothing but the JSONL sink will see these spans: take the lean path (see otel_train.tracers).
        tracer = LeanTracer(rt.jsonl, id_generator)
    start_step = None
    if settings.trace_per_step and ctx.run_id_known:
        start_step = step_span_starter(tracer, id_generator, ctx, settings.trace_group_size)
    jsonl = rt.jsonl
    api._tracing = api.Tracing(
        tracer=tracer,
        start_step_span=start_step,
        instant=jsonl.instant if jsonl is not None else no_instant,
        scalar=jsonl.scalar if jsonl is not None else _no_scalar,
        add_event=has_others,
    )


def no_instant(name: str, attrs: Mapping[str, Any] | None = None) -> None:
    return None


def _no_scalar(values: Mapping[str, Any]) -> None:
    return None


def _open_writer(settings: Settings, ctx: RunContext, log_dir: Path) -> RotatingFileWriter:
    name = S.trace_file_name(ctx.source, ctx.rank, time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(3))
    _check_own_dirs(settings, log_dir)
    try:
        _modes.make_dirs(log_dir)  # 0755 at most, whatever the umask
        # Written in the caller's thread: a record is in the kernel when the call that made it returns
        # (docs/runtime.md, "The write guarantee"); the ticker watches for a write that does not return.
        return RotatingFileWriter(
            log_dir / name,
            max_bytes=max(1, int(settings.max_file_size_mb * 1024 * 1024)),
            backup_count=settings.backup_count,
            fsync=settings.fsync,
        )
    except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (config rejects NUL)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _report.safe_str(exc)
        raise ConfigError(f"cannot write trace files in {log_dir!r}: {reason}; "
                          "set save_path (OTEL_TRAIN_SAVE_PATH) to a writable directory") from None


def _check_own_dirs(settings: Settings, log_dir: Path) -> None:
    """Refuse an existing run directory or structured_logs/ another user controls (otel_train._modes.foreign)."""
    if settings.allow_shared_dir:
        return
    for directory in (log_dir.parent, log_dir):
        why = _modes.foreign(directory)
        if why is not None:
            raise ConfigError(f"will not write trace files in {str(directory)!r}: {why}, so another user could "
                              "plant links there; use a directory of your own, or set allow_shared_dir=true "
                              "(OTEL_TRAIN_ALLOW_SHARED_DIR=1) if you trust everyone who can write to it")


def _static_fields(ctx: RunContext) -> dict[str, Any]:
    fields: dict[str, Any] = {
        S.RANK: ctx.rank, S.LOCAL_RANK: ctx.local_rank, S.WORLD_SIZE: ctx.world_size,
        S.HOST: ctx.host, S.PID: ctx.pid, S.ATTEMPT: ctx.attempt, S.RUN_ID: ctx.run_id, S.SOURCE: ctx.source,
    }
    if ctx.job_id is not None:
        fields[S.JOB_ID] = ctx.job_id
    return fields


def _library_dirs() -> tuple[str, ...]:
    # Frames in these packages are skipped when finding the user's caller: ours, OTel's, the stdlib's
    # logging (log records bridged to instants) and the training frameworks that call our hooks.
    import logging

    import otel_train.exporters

    modules = [sys.modules["otel_train"], otel_train.exporters, sys.modules["opentelemetry.trace"], logging]
    dirs = [os.path.dirname(os.path.abspath(module.__file__)) for module in modules]
    dirs[2] = os.path.dirname(dirs[2])  # all of opentelemetry, not just its trace package
    for name in ("torch", "lightning", "pytorch_lightning", "transformers", "accelerate"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(module.__file__))
    return tuple(dirs)
