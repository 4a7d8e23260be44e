"""A batching span processor whose shutdown is bounded and whose losses are counted.

The SDK's ``BatchSpanProcessor`` + OTLP exporter can block ``shutdown`` for tens of seconds while
the exporter retries an unreachable collector. Here every export runs on one daemon worker thread;
the caller only ever appends to a bounded queue, and ``shutdown`` abandons the worker at its
deadline (a daemon thread cannot keep the interpreter alive), counting what it could not deliver.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_EXPORT_TIMEOUT,
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_BSP_SCHEDULE_DELAY,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Sampler

from otel_train import _report
from otel_train._threads import Worker, held_here
from otel_train.errors import ConfigError

# The SDK's BatchSpanProcessor defaults, so OTEL_BSP_* means the same thing here.
_DEFAULT_MAX_QUEUE_SIZE = 2048
_DEFAULT_SCHEDULE_DELAY_MS = 5000.0
_DEFAULT_MAX_EXPORT_BATCH_SIZE = 512
_DEFAULT_EXPORT_TIMEOUT_MS = 30000.0

# Part of the shutdown budget kept for ``exporter.shutdown()``, which cancels an in-flight gRPC call
# and wakes an exporter sleeping in its retry backoff.
_EXPORTER_SHUTDOWN_SHARE = 0.2
_EXPORTER_SHUTDOWN_MAX_S = 0.25

# An empty context, not None: samplers read None as "the current context", whose span may be the
# ended span's parent.
_NO_PARENT = Context()


def _env_number(env: Mapping[str, str], key: str, default: float, *, integer: bool) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{key}={raw!r} is not {kind}; set it to a positive value or unset it.") from None
    return value


def _positive(name: str, value: float) -> float:
    if value <= 0:
        raise ConfigError(f"{name}={value!r} must be positive; pass a positive value or unset the OTEL_BSP_* variable.")
    return value


class BoundedBatchSpanProcessor(SpanProcessor):
    """Batches ended spans to an SDK ``SpanExporter`` on a daemon thread; never blocks the caller.

    ``dropped`` counts spans lost to a full queue, a failed export, or abandonment at shutdown;
    ``exported`` counts spans the exporter acknowledged with a success status (a redirect is a failed
    export: see ``wiring.CollectorRedirectRefusal``) and the collector did not reject in that answer (OTLP
    ``partial_success``: rejected spans are dropped, see ``otel_train._otlp_partial``). Spans a
    ``sampler`` rejects are neither.
    Export failures are reported once per exporter (``otel_train._report``); later ones are only counted.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int | None = None,
        schedule_delay_ms: float | None = None,
        max_export_batch_size: int | None = None,
        export_timeout_ms: float | None = None,
        sampler: Sampler | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        if max_queue_size is None:
            max_queue_size = int(_env_number(env, OTEL_BSP_MAX_QUEUE_SIZE, _DEFAULT_MAX_QUEUE_SIZE, integer=True))
        if schedule_delay_ms is None:
            schedule_delay_ms = _env_number(env, OTEL_BSP_SCHEDULE_DELAY, _DEFAULT_SCHEDULE_DELAY_MS, integer=False)
        if max_export_batch_size is None:
            max_export_batch_size = int(
                _env_number(env, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, _DEFAULT_MAX_EXPORT_BATCH_SIZE, integer=True)
            )
        if export_timeout_ms is None:
            export_timeout_ms = _env_number(env, OTEL_BSP_EXPORT_TIMEOUT, _DEFAULT_EXPORT_TIMEOUT_MS, integer=False)
        self.max_queue_size = int(_positive("max_queue_size", max_queue_size))
        self.schedule_delay_ms = float(_positive("schedule_delay_ms", schedule_delay_ms))
        self.max_export_batch_size = int(_positive("max_export_batch_size", max_export_batch_size))
        self.export_timeout_ms = float(_positive("export_timeout_ms", export_timeout_ms))
        # Like the SDK: a batch can never be larger than the queue that feeds it.
        self.max_export_batch_size = min(self.max_export_batch_size, self.max_queue_size)

        self.exporter = exporter
        self.sampler = sampler
        self.dropped = 0
        self.exported = 0
        self._is_shutdown = False
        self._start_worker()
        if hasattr(os, "register_at_fork"):
            self_ref = weakref.ref(self)

            def _after_in_child() -> None:
                processor = self_ref()
                if processor is not None:
                    processor._retire_in_child()

            os.register_at_fork(after_in_child=_after_in_child)

    def _retire_in_child(self) -> None:
        # A forked child (a DataLoader worker) inherits the queue and the exporter's connection, not
        # the worker thread; it is not the process whose spans these are (the parent exports them),
        # and otel-train traces nothing in a child until it calls init(), which builds its own
        # processors. So no thread starts here: the child's copy is shut down, holding nothing.
        self._lock = threading.RLock()
        self._queue = deque()
        self._flush_waiters = []
        self._is_shutdown = True
        self._worker.forget()

    def _start_worker(self) -> None:
        self._lock = threading.RLock()
        self._queue: deque[ReadableSpan] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._abandoned = False
        self._in_flight = 0
        self._flush_waiters: list[threading.Event] = []
        # quiet=False: these threads keep the starting thread's signal mask (the runtime's others block QUIET).
        self._worker = Worker("otel_train.otlp", self._run, quiet=False)
        self._worker.start()

    # -- caller side -----------------------------------------------------------------------------

    def holds_lock(self) -> bool:
        """Whether the calling thread is inside this processor's lock. A SIGTERM handler asks: the
        shutdown thread ends the open spans through :meth:`on_end`, which waits for it."""
        return held_here(self._lock)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do: only ended spans are exported."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue ``span`` for export (O(1)); drop and count it when the queue is full or after shutdown."""
        ctx = span.context
        if ctx is None or not ctx.trace_flags.sampled:
            return
        if self.sampler is not None and not self._sampled(span):
            return
        with self._lock:
            if self._is_shutdown or len(self._queue) >= self.max_queue_size:
                self.dropped += 1
                return
            self._queue.append(span)
            batch_ready = len(self._queue) >= self.max_export_batch_size
        if batch_ready:
            self._wake.set()

    def _sampled(self, span: ReadableSpan) -> bool:
        # No parent context: the decision depends on the trace id only, so ratio samplers keep or
        # drop a whole trace, and ParentBased samplers fall through to their root sampler.
        try:
            result = self.sampler.should_sample(_NO_PARENT, span.context.trace_id, span.name, span.kind, span.attributes)
        except Exception:  # noqa: BLE001 - a faulty custom sampler must not break training
            return True
        return result.decision.is_sampled()

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        """Export everything queued now; True when done within ``timeout_millis`` (default: export timeout)."""
        timeout_s = (self.export_timeout_ms if timeout_millis is None else timeout_millis) / 1000.0
        done = threading.Event()
        with self._lock:
            if self._is_shutdown:
                return not self._queue
            self._flush_waiters.append(done)
        self._wake.set()
        return done.wait(max(timeout_s, 0.0))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what can be delivered within ``timeout_s``, then stop; returns within ``timeout_s``.

        Spans still queued or in an export that has not finished by then count as dropped.
        """
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._lock:
            if self._is_shutdown:
                return
            self._is_shutdown = True
            self._stopping = True
        self._wake.set()
        reserve = min(timeout_s * _EXPORTER_SHUTDOWN_SHARE, _EXPORTER_SHUTDOWN_MAX_S)
        ended = self._worker.join(max(deadline - reserve - time.monotonic(), 0.0))
        with self._lock:
            if not ended:
                # Whatever the worker is doing now can no longer be waited for.
                self._abandoned = True
                self.dropped += self._in_flight + len(self._queue)
                self._queue.clear()
        self._shutdown_exporter(deadline)

    def _shutdown_exporter(self, deadline: float) -> None:
        # exporter.shutdown() may block (closing a channel, joining a transport): run it aside.
        closer = Worker("otel_train.otlp.close", self._call_exporter_shutdown, quiet=False)
        closer.start()
        closer.join(max(deadline - time.monotonic(), 0.0))

    def _call_exporter_shutdown(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception as exc:  # noqa: BLE001 - shutdown must never raise into user code
            _report.report_exception(f"shutting down {type(self.exporter).__name__}", exc)

    # -- worker side -----------------------------------------------------------------------------

    def _run(self) -> None:
        delay_s = self.schedule_delay_ms / 1000.0
        while True:
            self._wake.wait(delay_s)
            self._wake.clear()
            with self._lock:
                waiters, self._flush_waiters = self._flush_waiters, []
                stopping = self._stopping
            self._drain()
            for waiter in waiters:
                waiter.set()
            if stopping:
                return

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._abandoned or not self._queue:
                    return
                count = min(self.max_export_batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(count)]
                self._in_flight = count
            ok = self._export(batch)
            rejected, why = self._rejected(count) if ok else (0, "")
            with self._lock:
                self._in_flight = 0
                if self._abandoned:
                    return  # shutdown already counted this batch as dropped
                if ok:
                    self.exported += count - rejected
                    self.dropped += rejected
                else:
                    self.dropped += count
            if not ok:
                self._report_failure(count)
            elif rejected:
                self._report_rejected(rejected, count, why)

    def _export(self, batch: list[ReadableSpan]) -> bool:
        try:
            return self.exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception:  # noqa: BLE001 - an exporter bug must not kill the worker
            return False

    def _rejected(self, count: int) -> tuple[int, str]:
        """Spans of a successful export the collector still rejected (OTLP ``partial_success``, counted by
        ``otel_train._otlp_partial`` through ``wiring``), at most ``count``, and its message."""
        take = getattr(self.exporter, "_otel_train_rejections", None)
        if not callable(take):
            return 0, ""
        try:
            rejected, why = take()
        except Exception:  # noqa: BLE001 - counting must not kill the worker
            return 0, ""
        return min(max(int(rejected), 0), count), str(why)

    def _report_rejected(self, rejected: int, count: int, why: str) -> None:
        name = type(self.exporter).__name__
        _report.report(
            f"otlp rejected:{name}",
            f"the collector answered success for {count} spans and rejected {rejected} of them (OTLP partial_success"
            + (f": {why}" if why else "") + "); they are dropped and counted (otel_train.spans_dropped at shutdown)",
        )

    def _report_failure(self, count: int) -> None:
        # Why, when the exporter can say (otel_train.exporters.otlp.wiring.CollectorRedirectRefusal): a redirect.
        explain = getattr(self.exporter, "_otel_train_explain", None)
        why = explain() if callable(explain) else None
        _report.report(
            f"otlp export:{type(self.exporter).__name__}",
            f"{type(self.exporter).__name__} could not export {count} spans"
            + (f" ({why})" if why else "")
            + "; they are dropped and counted (otel_train.spans_dropped at shutdown). Check "
            "OTEL_EXPORTER_OTLP_ENDPOINT and that the collector is reachable",
        )


def shutdown_processors(processors: Iterable[BoundedBatchSpanProcessor], timeout_s: float = 5.0) -> None:
    """Shut several processors down in parallel, all within one ``timeout_s`` budget.

    ``TracerProvider.shutdown()`` would call them one after another with their default budget each;
    call this first, and the provider's later calls return at once (shutdown is idempotent).
    """
    workers = [
        Worker("otel_train.otlp.shutdown", functools.partial(p.shutdown, timeout_s), quiet=False) for p in processors
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + max(timeout_s, 0.0)
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0.0))
