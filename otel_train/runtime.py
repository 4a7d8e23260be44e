"""``init`` / ``shutdown``: builds the tracer provider, processors and sinks; process lifecycle hooks.

Flow: user call (``otel_train.api``) → SDK span → processors (JSONL first, then training-context
attributes, then OTLP/console/custom) → sinks. Startup is strict (``ConfigError``); afterwards nothing
here raises into training code.
"""

from __future__ import annotations

import atexit
# Imported before any TracerProvider exists, on purpose: the SDK's provider re-detects resources in a
# forked child through a ThreadPoolExecutor, and concurrent.futures re-initialises its global lock in
# the child only in its own after-fork hook. Hooks run in registration order, so this module's must be
# registered first, or every fork child (DataLoader workers included) deadlocks in the SDK's hook.
import concurrent.futures.thread  # noqa: F401
import os
import random
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID, Link, SpanContext, TraceFlags

from otel_train import _modes, _report, api, profiling
from otel_train import context as step_context
from otel_train import schema as S
from otel_train._version import __version__
from otel_train.config import Settings, resolve_settings
from otel_train.errors import ConfigError
from otel_train.redact import Redactor
from otel_train.exporters.jsonl.encoder import CallerFinder, RecordEncoder, check_sdk_span_fields, step_context_attrs
from otel_train.exporters.jsonl.processor import JsonlSpanProcessor
from otel_train.exporters.jsonl.writer import RotatingFileWriter
from otel_train.exporters.otlp import BoundedBatchSpanProcessor, build_span_processors, shutdown_processors
from otel_train.handlers import load_handlers
from otel_train.phases import STEP
from otel_train.resource import RunContext, build_resource, detect_run_context
from otel_train.spans import CleanTracer, LeanTracer
from otel_train.digest import DigestWriter
from otel_train.watchdog import Watchdog
from otel_train import sigterm

SIGTERM_SHUTDOWN_TIMEOUT_S = 3.0
SHUTDOWN_FILE_FLOOR_S = 1.0  # what shutdown leaves the trace file's last records after the exporters, at least
SIGTERM_HANDLER_WAIT_S = SIGTERM_SHUTDOWN_TIMEOUT_S + SHUTDOWN_FILE_FLOOR_S + 1.0
"""How long the SIGTERM handler waits for the shutdown thread before it lets the interrupted code go on
(otel_train/sigterm.py): longer than any shutdown that needs nothing of that code."""
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class StepTraceIdGenerator(IdGenerator):
    """Random ids from a private generator, except ids requested for the next span on this thread.

    Private, because training code seeds and restores the global ``random`` state (every rank with the
    same seed; Lightning's ``isolate_rng``), which would make the SDK's default ids collide.
    """

    def __init__(self) -> None:
        self._random = random.Random(os.urandom(16))
        self._next = threading.local()

    def request_trace_id(self, trace_id: int) -> None:
        self._next.trace_id = trace_id

    def request_span_id(self, span_id: int) -> None:
        self._next.span_id = span_id

    def generate_span_id(self) -> int:
        span_id = getattr(self._next, "span_id", None)
        if span_id is not None:
            self._next.span_id = None
            return span_id
        span_id = self._random.getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = self._random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._next, "trace_id", None)
        if trace_id is not None:
            self._next.trace_id = None
            return trace_id
        trace_id = self._random.getrandbits(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = self._random.getrandbits(128)
        return trace_id


class TrainingContextProcessor(SpanProcessor):
    """Copies the step context onto spans as ``training.*`` attributes, for OTLP and custom sinks; an
    attribute of that name the user gave is kept as given."""

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        given = span._attributes
        for key, value in step_context_attrs(step_context.current()).items():
            if not given or key not in given:
                span.set_attribute(key, value)


class _Runtime:
    """Everything one ``init`` built, so ``shutdown`` can take it down in order."""

    def __init__(self, settings: Settings, ctx: RunContext) -> None:
        self.settings = settings
        self.ctx = ctx
        self.pid = os.getpid()
        self.provider: TracerProvider | None = None
        self.jsonl: JsonlSpanProcessor | None = None
        self.writer: RotatingFileWriter | None = None
        self.batch_processors: list[BoundedBatchSpanProcessor] = []
        self.other_processors: list[SpanProcessor] = []
        self.record_handlers: list[Any] = []
        self.undo: list[Any] = []  # uninstallers for hooks, run in reverse at shutdown
        self.file_path: str | None = None
        self.watchdog: Watchdog | None = None
        self.comm: Any = None  # otel_train.comm.CommSession
        self.ids: StepTraceIdGenerator | None = None  # every span's ids (the comm herald chooses some ahead)


_lock = threading.RLock()
_active: _Runtime | None = None
_process_hooks_installed = False


def is_enabled() -> bool:
    """Whether tracing is active in this process."""
    return _active is not None


def current_settings() -> Settings | None:
    """The settings of the active runtime, or None when tracing is off."""
    rt = _active
    return rt.settings if rt is not None else None


def trace_file() -> str | None:
    """Path of this process's active JSONL file, or None."""
    rt = _active
    return rt.file_path if rt is not None else None


def init(save_path: str | os.PathLike[str] | None = None, config: Mapping[str, Any] | None = None,
         **overrides: Any) -> None:
    """Start tracing for this process (see docs/settings.md). Raises ConfigError before training starts."""
    global _active
    with _lock:
        if _active is not None:
            raise ConfigError("otel_train.init() was already called in this process; "
                              "call otel_train.shutdown() before initialising again")
        settings = resolve_settings(save_path=None if save_path is None else os.fspath(save_path),
                                    config=config, overrides=overrides)
        if not settings.enabled:
            return
        ctx = detect_run_context(settings)
        _check_comm(settings)
        _report.reset()  # a new session reports (and counts, for its process_end) afresh
        rt = _Runtime(settings, ctx)
        try:
            _build(rt)
            if settings.fr_dir is None:
                _check_fr_dir(settings)
        except BaseException:
            _teardown_partial(rt)
            raise
        _active = rt
        _install_process_hooks()
        _shutdown_at_multiprocessing_exit()
        _make_comm(rt)
        _start_comm(rt)  # before process_start, which says what it patched
        _start_lifecycle(rt)
        _start_watchdog(rt)
        if rt.watchdog is not None and rt.comm is not None:
            rt.watchdog.on_stall = rt.comm.on_stall
        rt.undo.append(profiling.start(settings, rt.ctx, rt.jsonl, rt.watchdog))  # docs/profiling.md


def _check_comm(settings: Settings) -> None:
    """``collectives=on`` that cannot be honoured, or an unwritable ``fr_dir``: one line, before any file."""
    from otel_train.comm.session import check_available

    reason = check_available(settings.collectives)
    if reason is not None:
        raise ConfigError(f"collectives='on' (OTEL_TRAIN_COLLECTIVES) cannot be honoured: {reason}; "
                          "install torch with distributed support or set collectives to 'auto' or 'off'")
    if settings.fr_dir is not None:
        _check_fr_dir(settings)


def _check_fr_dir(settings: Settings) -> None:
    """Make ``fr_dir``, or say in one line why it cannot be. The default (``<save_path>/flight_recorder``)
    is made once the trace file is open, so a bad ``save_path`` is named as such."""
    try:
        _modes.make_dirs(settings.fr_path)  # 0755 at most, whatever the umask (otel_train._modes)
        if not os.access(settings.fr_path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _report.safe_str(exc)
        raise ConfigError(f"cannot write Flight Recorder dumps in {settings.fr_path!r}: {reason}; "
                          "set fr_dir (OTEL_TRAIN_FR_DIR) to a writable directory") from None


def _make_comm(rt: _Runtime) -> None:
    # The communication recorder (otel_train.comm): its Flight Recorder environment is set now, before
    # process_start says what it found; its patches and thread start after the watchdog.
    from otel_train.comm.session import CommSession

    tracing, jsonl = api._tracing, rt.jsonl
    if tracing is None:
        return
    rt.comm = CommSession(
        mode=rt.settings.collectives, fr_dir=rt.settings.fr_path, rank=rt.ctx.rank, attempt=rt.ctx.attempt,
        world_size=rt.ctx.world_size, tracer=tracing.tracer,
        instant=jsonl.instant_for if jsonl is not None else _no_instant,
        open_entries=jsonl.open_entries if jsonl is not None else None,
        closed_feed=(lambda feed: setattr(jsonl, "closed_entries", feed)) if jsonl is not None else None,
        arrival=jsonl.arrival if jsonl is not None else None, ids=rt.ids,
    )


def _start_comm(rt: _Runtime) -> None:
    comm = rt.comm
    if comm is None:
        return
    rt.undo.append(comm.stop)
    try:
        comm.start()
    except Exception as exc:  # tracing goes on without comm spans; training never hears of it
        _report.report_exception("starting the comm recorder (no comm.* spans)", exc)


def _build(rt: _Runtime) -> None:
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
        # Nothing but the JSONL sink will see these spans: take the lean path (see otel_train.spans).
        tracer = LeanTracer(rt.jsonl, id_generator)
    start_step = None
    if settings.trace_per_step and ctx.run_id_known:
        start_step = _step_span_starter(tracer, id_generator, ctx, settings.trace_group_size)
    jsonl = rt.jsonl
    api._tracing = api.Tracing(
        tracer=tracer,
        start_step_span=start_step,
        instant=jsonl.instant if jsonl is not None else _no_instant,
        scalar=jsonl.scalar if jsonl is not None else _no_scalar,
        add_event=has_others,
    )


def _no_instant(name: str, attrs: Mapping[str, Any] | None = None) -> None:
    return None


def _no_scalar(values: Mapping[str, Any]) -> None:
    return None


def _step_span_starter(tracer: trace.Tracer, ids: StepTraceIdGenerator, ctx: RunContext, group_size: int) -> Any:
    """Step N of the ranks of one group (``rank // group_size``) shares a trace; every step span links to
    the step's anchor, rank 0's step span in group 0's trace (docs/deploy.md, "One step across groups").
    All ids come from the run id, step, group and attempt: no rank talks to another."""
    empty = Context()
    run_id, group, attempt, anchor = ctx.run_id, ctx.rank // group_size, ctx.attempt, ctx.rank == 0
    link_attrs = {S.ATTR_LINK: S.LINK_STEP_ANCHOR}

    def start_step_span(attrs: Mapping[str, Any] | None) -> trace.Span:
        step = step_context.current().step
        if step is None:
            return tracer.start_span(STEP, attributes=attrs)
        # A root span of the group's trace for this step; links to what encloses it and to the anchor.
        outer = trace.get_current_span().get_span_context()
        links = [Link(outer)] if outer.is_valid else []
        anchor_id = S.step_anchor_span_id(run_id, step, attempt)
        if anchor:
            ids.request_span_id(anchor_id)
        else:
            anchor_ctx = SpanContext(S.step_trace_id(run_id, step, 0), anchor_id, True, _SAMPLED)
            links.append(Link(anchor_ctx, link_attrs))
        ids.request_trace_id(S.step_trace_id(run_id, step, group))
        return tracer.start_span(STEP, context=empty, attributes=attrs, links=links or None)

    return start_step_span


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


def _start_lifecycle(rt: _Runtime) -> None:
    from otel_train import _clock, lifecycle, logbridge
    from otel_train.telemetry import TelemetrySampler

    settings = rt.settings
    if rt.jsonl is not None:
        attrs = lifecycle.process_start_attrs(settings, rt.ctx)
        if rt.comm is not None:
            attrs["comm"] = dict(rt.comm.status)
        attrs["clock"] = _clock.anchor()  # the records' clock (docs/clock.md): which wall time it started from
        rt.jsonl.instant(S.INSTANT_PROCESS_START, attrs)
    rt.undo.append(lifecycle.install_exception_hooks())
    if settings.log_bridge:
        rt.undo.append(logbridge.install(settings.log_level))
    if settings.telemetry_every > 0:
        sampler = TelemetrySampler(settings.telemetry_sources, settings.telemetry_every)
        step_context.step_listeners.append(sampler.on_step)

        def remove_sampler() -> None:
            if sampler.on_step in step_context.step_listeners:
                step_context.step_listeners.remove(sampler.on_step)
            sampler.close()

        rt.undo.append(remove_sampler)


def _start_watchdog(rt: _Runtime) -> None:
    # Heartbeats and stall records (otel_train.watchdog), written through the JSONL sink; stopped
    # first at shutdown. A fork child has none until it calls init() itself.
    settings, jsonl = rt.settings, rt.jsonl
    if not settings.watchdog or jsonl is None:
        return
    # The digest (otel_train.digest) is written from the watchdog's thread: none without a trace file.
    digest = DigestWriter(rt.file_path, settings.digest_s) if settings.digest_s and rt.file_path else None
    watchdog = rt.watchdog = Watchdog(jsonl, heartbeat_s=settings.heartbeat_s, stall_min_s=settings.stall_min_s,
                                      stall_factor=settings.stall_factor, digest=digest)
    jsonl.ended = watchdog.ended
    watchdog.start()

    def stop() -> None:
        watchdog.stop()
        jsonl.ended = None  # what shutdown then ends as incomplete is no duration: the final digest leaves it out

    rt.undo.append(stop)


def shutdown(timeout_s: float = 5.0) -> None:
    """End still-open spans as incomplete, flush and close everything; returns within ``timeout_s`` (or
    ``SHUTDOWN_FILE_FLOOR_S`` after the exporters, when they took it all: the trace file's last records)."""
    global _active
    deadline = time.monotonic() + max(0.0, timeout_s)
    rt = _active
    if rt is None or rt.pid != os.getpid():
        # A fork child between fork and its after-fork hook (a SIGTERM from Pool.terminate lands
        # there) still sees its parent's runtime: it must neither end the parent's spans in the
        # parent's file nor touch locks or threads it inherited mid-use.
        return
    with _lock:
        rt = _active
        if rt is None:
            return
        _active = None
        api._tracing = None  # new calls are no-ops from here on; in-flight spans are ended below
        for undo in reversed(rt.undo):
            _quietly(undo)
        jsonl = rt.jsonl
        if jsonl is not None:
            jsonl.finish_by(max(deadline, time.monotonic() + SHUTDOWN_FILE_FLOOR_S))  # a stalled write: bounded
        incomplete = jsonl.end_open_spans() if jsonl is not None else 0
        _quietly(shutdown_processors, rt.batch_processors, max(0.0, deadline - time.monotonic()))
        dropped = sum(processor.dropped for processor in rt.batch_processors)
        for processor in rt.other_processors:
            _quietly(processor.shutdown)
        if dropped:
            _report.report("spans dropped", f"{dropped} span(s) could not be exported (collector unreachable or "
                           "queue full); the JSONL file has them all")
        if jsonl is not None:
            # Every wait for the write lock from here on (a stalled write holds it) is bounded by the
            # deadline (the exporters may have spent it: the file's last records get FILE_FLOOR_S still).
            jsonl.finish_by(max(deadline, time.monotonic() + SHUTDOWN_FILE_FLOOR_S))
            if rt.watchdog is not None:
                _quietly(rt.watchdog.final_digest)
            _finish_file(jsonl, rt.writer, incomplete, dropped)
        _report_at_shutdown(jsonl.dropped_records if jsonl is not None else 0,
                            jsonl.records_written if jsonl is not None else 0)
        for handler in rt.record_handlers:
            if callable(getattr(handler, "shutdown", None)):
                _quietly(handler.shutdown)
        step_context.reset()  # a later init() is a new session: relative steps count afresh


def _finish_file(jsonl: JsonlSpanProcessor, writer: RotatingFileWriter | None, incomplete: int, dropped: int) -> None:
    if dropped:
        jsonl.instant(S.INSTANT_SPANS_DROPPED, {"count": dropped})
    if writer is not None and (writer.errors or writer.lost_records):
        jsonl.instant(S.INSTANT_WRITE_ERRORS, {"count": writer.errors, "dropped_bytes": writer.dropped_bytes,
                                               "lost_records": writer.lost_records, "lost_bytes": writer.lost_bytes})
    jsonl.finish(S.INSTANT_PROCESS_END, lambda seq, dropped_records: {
        "records": seq,
        "incomplete_spans": incomplete,
        "spans_dropped": dropped,
        "write_errors": writer.errors if writer is not None else 0,
        "dropped_records": dropped_records,
        **_comm_lost(),
        **({"signal": _end_signal} if _end_signal else {}),
    })


def _comm_lost() -> dict[str, int]:
    """``comm_ops_lost``: comm ops without a span (the Flight Recorder buffer wrapped; docs/comm.md, "Cost")."""
    lost = _report.counts().get("comm.flight_recorder_lost", 0)
    return {"comm_ops_lost": lost} if lost else {}


def _report_at_shutdown(dropped_records: int, made: int) -> None:
    # Each fault printed one line when it first happened; one more line says what it all added up to
    # (process_end may not have reached the file: a stalled writer, docs/runtime.md).
    parts = []
    if dropped_records:
        parts.append(f"{dropped_records} record(s) of this process are not in its trace file "
                     f"(process_end.dropped_records; {made} made)")
    repeated = {key: n for key, n in _report.counts().items() if n > 1}
    if repeated:
        parts.append("faults seen more than once: " + ", ".join(f"{key} ×{n}" for key, n in sorted(repeated.items())))
    if parts:
        _report.logger.warning("otel-train: at shutdown: %s", "; ".join(parts))


def _teardown_partial(rt: _Runtime) -> None:
    api._tracing = None
    _quietly(shutdown_processors, rt.batch_processors, 0.5)
    if rt.writer is not None:
        rt.writer.close()


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # shutdown must finish whatever one part does
        _report.report_exception(f"shutdown step {getattr(fn, '__qualname__', fn)!r}", exc)


# Process lifecycle: exit, SIGTERM, fork.

def _install_process_hooks() -> None:
    global _process_hooks_installed
    if not _process_hooks_installed:
        _process_hooks_installed = True  # atexit and fork hooks are inherited by fork children
        atexit.register(shutdown)
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                            after_in_child=_after_fork_in_child)
    if _sigterm_previous is _NOT_CHAINED and _sigterm_watch is None:
        if _multiprocessing_child() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            pass  # a multiprocessing worker dies of SIGTERM at once, as without us (below)
        elif threading.current_thread() is not threading.main_thread():
            _watch_sigterm()  # init off the main thread (Ray Train workers): no Python handler possible
        else:
            _chain_sigterm()  # again in a fork child that calls init: the child dropped ours


def _multiprocessing_child() -> bool:
    """Whether this process is a multiprocessing worker (a Pool's, a DataLoader's, any Process).

    There SIGTERM keeps its default action: the kernel ends the worker at once, as without otel-train,
    and the worker's file ends without ``process_end`` (what its writer thread had not yet written is
    lost, as on SIGKILL; docs/runtime.md). ``Pool.terminate`` and DataLoader shutdown SIGTERM workers
    that may be anywhere, and a worker must die of it: with a handler of ours it did not, within 16 – 300
    pools beside a busy loop (once in 40 runs of the fault suite), and the pool's ``join`` waited
    forever. The worker's main thread sits in its task queue's semaphore, and a SIGTERM that landed in
    ``init`` (deferred by the Python handler, or taken by the C-level watcher used off the main thread)
    was sometimes never acted on. A worker that leaves normally still ends its file cleanly
    (:func:`_shutdown_at_multiprocessing_exit`)."""
    mp = sys.modules.get("multiprocessing")
    try:
        return mp is not None and mp.parent_process() is not None
    except Exception:  # noqa: BLE001 - a multiprocessing we do not know: the main-thread handler
        return False


def _shutdown_at_multiprocessing_exit() -> None:
    # A multiprocessing fork/forkserver worker leaves through os._exit, which skips atexit; its exit
    # path still runs multiprocessing's own finalizers, so a worker that called init() ends cleanly.
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:
        import multiprocessing.util

        multiprocessing.util.Finalize(None, shutdown, exitpriority=0)


def _chain_sigterm() -> None:
    global _sigterm_handler, _sigterm_previous
    previous = signal.getsignal(signal.SIGTERM)
    handler = sigterm.MainThreadHandler(previous, _shutdown_on_signal, _mid_record, SIGTERM_HANDLER_WAIT_S)
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        handler.close()
        return
    handler.start()
    _sigterm_handler, _sigterm_previous = handler, previous
    _watch_stuck_main(handler)


def _watch_stuck_main(handler: sigterm.MainThreadHandler) -> None:
    """Chain ``faulthandler``'s C handler in front of CPython's, for a SIGTERM that lands while the main
    thread is stuck in a C call (otel_train/sigterm.py, :class:`sigterm.StuckMainWatch`). Without it such
    a SIGTERM waits for the call to return, where the process would have died at once without us."""
    watch = sigterm.StuckMainWatch(handler, _die_of_sigterm)
    try:
        import faulthandler

        faulthandler.register(signal.SIGTERM, file=watch.wake_w, all_threads=False, chain=True)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        watch.close()
        _report.report("sigterm stuck main",
                       f"faulthandler could not watch SIGTERM ({_report.safe_str(exc)}): a SIGTERM that comes while "
                       "the main thread is inside a C call (a collective that waits for a peer) waits for that call")
        return
    handler.watch = watch
    watch.start()


def _shutdown_on_signal() -> None:
    global _end_signal
    _end_signal = "SIGTERM"  # process_end says so (signal): the analyses tell it from a death
    try:
        shutdown(SIGTERM_SHUTDOWN_TIMEOUT_S)
    finally:
        _end_signal = None


def _watch_sigterm() -> None:
    """SIGTERM handling when ``init`` runs off the main thread, where Python refuses ``signal.signal``.

    While SIGTERM has its default action, ``faulthandler`` (whose C handler any thread may install)
    takes it: on a SIGTERM it writes the threads' stacks into the shutdown thread's pipe and returns, so
    the process lives on; that thread shuts down (process_end, ``signal``), puts the default action back
    and sends itself SIGTERM: the process dies of it as it would have without us. A handler the main
    thread already set is left alone (it exits, as a rule, and exit runs shutdown). When none of this
    can be set up, one line says so at init.
    """
    global _sigterm_watch
    previous = signal.getsignal(signal.SIGTERM)
    if previous != signal.SIG_DFL:
        return
    where = threading.current_thread().name
    watch = None
    try:
        import faulthandler

        watch = sigterm.ShutdownThread(_shutdown_on_signal, _die_of_sigterm, raw=True)
        faulthandler.register(signal.SIGTERM, file=watch.wake_w, all_threads=False, chain=False)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        if watch is not None:
            watch.close()
        _report.report("sigterm off the main thread",
                       f"otel_train.init() ran in thread {where!r}, not the main thread, and no SIGTERM watcher could "
                       f"be set up ({_report.safe_str(exc)}): a SIGTERM will end this process without process_end. "
                       "Call init() from the main thread")
        return
    _sigterm_watch = watch
    watch.start()


def _die_of_sigterm() -> None:
    """From a thread (either watcher): faulthandler lets go of SIGTERM, whose default action comes back
    (put back through libc where a Python handler held it), and the process dies of it, as without us."""
    import faulthandler

    faulthandler.unregister(signal.SIGTERM)
    sigterm.die_of_sigterm_off_main()


def _unwatch_sigterm_in_child() -> None:
    # A fork child must not feed its parent's watcher (the pipe is shared): SIGTERM acts by default there.
    global _sigterm_watch
    watch, _sigterm_watch = _sigterm_watch, None
    if watch is None:
        return
    import faulthandler

    faulthandler.unregister(signal.SIGTERM)
    watch.close()


# A SIGTERM that reaches a fork child before CPython's own after-fork code runs is lost: that code
# clears the flags its C-level handler set, so a Python handler never runs and the child lives on
# (a multiprocessing.Pool worker terminated right after its fork then blocks its pool's join
# forever). So the forking thread blocks SIGTERM around fork(); the child puts back the handler that
# was there before ours (it traces nothing until it calls init) and only then unblocks, so a SIGTERM
# that arrived meanwhile acts as it would have without otel-train.
_NOT_CHAINED: Any = object()
_sigterm_previous: Any = _NOT_CHAINED
_sigterm_handler: sigterm.MainThreadHandler | None = None  # the main thread's handler, once installed
_sigterm_watch: sigterm.ShutdownThread | None = None  # the off-main-thread watcher (faulthandler feeds it)
_end_signal: str | None = None  # set while shutdown runs for a signal
_fork_mask = threading.local()


def _before_fork() -> None:
    if _sigterm_previous is not _NOT_CHAINED or _sigterm_watch is not None:
        _fork_mask.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _after_fork_in_parent() -> None:
    old = getattr(_fork_mask, "old", None)
    if old is not None:
        _fork_mask.old = None
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _restore_sigterm_in_child() -> None:
    global _sigterm_previous, _sigterm_handler
    _unwatch_sigterm_in_child()
    if _sigterm_handler is not None:
        # Its threads are not in this process: its pipes go, and faulthandler, which writes into the
        # parent's watch pipe, lets go of SIGTERM first. Where the previous handler cannot be put back
        # (one installed from C), it stays, and shuts down in place, as before there were threads.
        if _sigterm_handler.watch is not None:
            import faulthandler

            faulthandler.unregister(signal.SIGTERM)
        _sigterm_handler.close()
    if _sigterm_previous is not _NOT_CHAINED:
        try:
            signal.signal(signal.SIGTERM, _sigterm_previous)
        except (ValueError, OSError, TypeError):  # a previous handler installed from C: leave ours
            pass
        else:
            _sigterm_previous = _NOT_CHAINED
            _sigterm_handler = None  # a later init in this child installs a handler of its own
    _after_fork_in_parent()  # the same mask restore, now in the child


def _mid_record() -> bool:
    """Whether this thread holds the runtime's lock, the JSONL processor's (a record in progress) or an
    export processor's (a span being queued). The shutdown thread needs each of them, so a SIGTERM that
    lands there is taken again 5 ms later rather than waited out (otel_train/sigterm.py)."""
    if _lock._is_owned():  # type: ignore[attr-defined]
        return True
    rt = _active
    if rt is None:
        return False
    return (rt.jsonl is not None and rt.jsonl.holds_lock()) or any(p.holds_lock() for p in rt.batch_processors)


def _after_fork_in_child() -> None:
    # A forked child (DataLoader worker, multiprocessing) must never write into its parent's file:
    # it traces nothing until it calls init() itself, which opens a file of its own and, being a new
    # process, counts relative steps from its own first step.
    global _active
    _active = None
    api._tracing = None
    _restore_sigterm_in_child()
    step_context.step_listeners.clear()
    step_context.reset()
