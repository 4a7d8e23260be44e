"""The JSONL sink: a SpanProcessor that writes a record when a span starts and when it ends.

It is a processor, not an exporter, on purpose: an exporter only ever sees ended spans, and the whole
point is that a hung or killed rank's open spans are already on disk.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import msgspec
from opentelemetry.trace import INVALID_SPAN_CONTEXT, SpanContext, TraceFlags, get_current_span
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from otel_train import _report
from otel_train._threads import held_here
from otel_train.record_clock import from_wall, now_ns as time_ns  # the runtime's one clock (docs/clock.md)
from otel_train import context as step_context
from otel_train import schema as S
from otel_train.context import StepState
from otel_train.exporters.jsonl.encoder import INCOMPLETE_ATTR, CallerFinder, RecordEncoder
from otel_train.tracers import LeanSpan

_decode = msgspec.json.decode
get_native_id = threading.get_native_id
current_state = step_context.current

RecordHandler = Callable[[dict], None]
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
OpenEntry = tuple[Span, str, StepState, int]
"""An open span: the span, its encoded body, the step context and native thread id it started with."""
class OnBehalf(threading.local):
    """Set by a thread that writes spans for another thread (the comm recorder, otel_train.comm): the
    native thread id those spans' records carry. Their records have no ``caller``."""

    tid: int | None = None


on_behalf = OnBehalf()
RUNTIME_LOCK_WAIT_S = 1.0
"""The watchdog's records wait at most this long for a write in progress (one blocked on a hung disk
must not stop the watchdog too); such a record is skipped, counted and reported once."""
LOCK_WAIT_S = 5.0
"""A record waits for another thread's record in progress until the writer is judged stalled (``STALL_S``:
then it is dropped and counted at once), and never longer than this (a record handler that hangs)."""
LOCK_POLL_S = 0.05
_monotonic = time.monotonic


class JsonlSpanProcessor(SpanProcessor):
    """Writes schema-v1 records to a writer (one ``write`` call per line) and hands them to record handlers.

    ``writer`` is anything with ``write(bytes) -> bool`` and ``close()`` (the runtime's is a
    RotatingFileWriter: the record is in the kernel when ``write`` returns, docs/runtime.md, "The write
    guarantee"), or None when only record handlers want the records. Never raises into the caller: an
    internal fault is reported through ``otel_train._report`` (once per kind, every occurrence counted).

    While another thread's record is being written, a record waits for it; once the writer is
    ``stalled`` (a write that does not return) it waits no more: it is dropped and counted
    (``stall_dropped``), never queued.
    """

    def __init__(
        self,
        writer: Any,
        encoder: RecordEncoder,
        *,
        caller: CallerFinder | None = None,
        record_handlers: Iterable[RecordHandler] = (),
        redact: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self._writer = writer
        # Every record passes through it before anyone sees it (otel_train.redact.Redactor.record).
        self._redact = redact
        self._encoder = encoder
        self._caller = caller
        self._handlers = tuple(record_handlers)
        # Reentrant, so a thread can say whether it holds it (holds_lock: the SIGTERM handler asks).
        # Everything that assigns a seq or changes the open-span table happens under it, so a record
        # is either wholly written or not begun, and shutdown sees a consistent table.
        self._lock = threading.RLock()
        self._seq = 0
        self._open: dict[int, OpenEntry] = {}
        # Set by the watchdog (otel_train.watchdog): each span that ends is appended here, one C call on
        # the hot path; the watchdog's thread drains it into its per-name duration sketch.
        self.ended: deque[Any] | None = None
        # Set by the comm recorder (otel_train.comm.recorder): each span's open entry is appended here just
        # before it leaves the open table (so every span is in one of the two), to parent ops seen only
        # in Flight Recorder's buffer by the span open when they were issued (docs/comm.md).
        self.closed_entries: deque[Any] | None = None
        self._sealed = False  # shutdown has ended the open spans: no new span is written
        self._closed = False  # the last record is written: nothing more is
        self.unencodable = 0  # records that could not be made at all (they have no seq)
        self.stall_dropped = 0  # records not made: the write lock was held by a stalled write (no seq either)
        self._stall_dropped_since = 0  # stall_dropped at the last stall notice
        self._deadline = 0.0  # monotonic; shutdown's bound on every wait for the lock (0.0: none)
        self._unwritten: set[int] = set()  # spans whose start was dropped: their end is dropped too
        # Starts written by arrival(), their spans not begun yet: span id -> ((name, attrs, start ns, parent,
        # trace id): what a LeanSpan needs, (body, step context, tid): the rest of its OpenEntry).
        self._arrived: dict[int, tuple[tuple[Any, ...], tuple[str, StepState, int]]] = {}
        if writer is not None and hasattr(writer, "on_loss"):
            writer.on_loss = self._on_loss
        if writer is not None and hasattr(writer, "on_notice"):
            writer.on_notice = self._on_notice

    @property
    def records_written(self) -> int:
        """Records made so far (``seq`` of the last one)."""
        return self._seq

    @property
    def dropped_records(self) -> int:
        """Records made but not in the file: not encodable, not written, or lost with a deleted file."""
        writer_drops = getattr(self._writer, "dropped_records", 0) if self._writer is not None else 0
        return self.unencodable + self.stall_dropped + writer_drops

    def finish_by(self, deadline: float) -> None:
        """From now on no wait for the lock lasts past ``deadline`` (``time.monotonic()``): shutdown's bound."""
        self._deadline = deadline

    def _entered(self, what: str) -> bool:
        """The lock taken, at once or as :meth:`_wait_lock` allows (the hot paths inline the first try)."""
        return self._lock.acquire(False) or self._wait_lock(what)

    def _wait_lock(self, what: str) -> bool:
        """The lock is busy: wait while the record in progress is being written (True once taken). False,
        the record dropped and counted, once the writer is stalled or after ``LOCK_WAIT_S`` (or shutdown's
        deadline): a thread stuck in a write never takes the others with it."""
        lock, start = self._lock, _monotonic()
        end = start + LOCK_WAIT_S
        if self._deadline:
            end = min(end, self._deadline)
        while not self._writer_stalled():
            if lock.acquire(timeout=max(0.0, min(LOCK_POLL_S, end - _monotonic()))):
                return True
            if _monotonic() >= end:
                break
        self.stall_dropped += 1
        _report.report("records dropped: write stalled",
                       f"{what} record was dropped: another thread's record write has not returned for "
                       f"{_monotonic() - start:.1f} s (a stalled trace file, docs/runtime.md); such records are "
                       "counted in process_end.dropped_records")
        return False

    def _writer_stalled(self) -> bool:
        return bool(getattr(self._writer, "stalled_since", 0.0))

    def holds_lock(self) -> bool:
        """Whether the calling thread is in the middle of writing a record (a signal handler asks)."""
        return held_here(self._lock)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            state, tid = current_state(), on_behalf.tid
            if tid is None:
                tid = get_native_id()
                caller = self._caller() if self._caller is not None else ""
            else:
                caller = ""
            body = self._encoder.span_body(span, state, tid)
            lock = self._lock
            if not lock.acquire(False) and not self._wait_lock("a span start"):
                self._unwritten.add(span._context.span_id)  # its end is dropped too
                return
            try:
                if self._sealed:
                    return  # started while shutdown ran: not traced, like any call after it
                if self._arrived and self._adopt(span):
                    return
                seq = self._seq + 1
                line = self._encoder.span_start(span, body, seq, caller)
                self._seq = seq
                self._open[span._context.span_id] = (span, body, state, tid)
                self._write(line)
            finally:
                lock.release()
        except Exception as exc:  # never break training over a trace record
            self._fault("a span start", exc)

    def arrival(self, name: str, attrs: Mapping[str, Any], start_ns: int, parent: SpanContext | None,
                trace_id: int, span_id: int, tid: int) -> None:
        """The start record of a span that the runtime begins later, on another thread, with these ids (an
        op's arrival, written by the thread that issues it: otel_train/comm/herald.py). When that span
        starts, :meth:`on_start` only records it as open; one never begun is ended ``incomplete`` at shutdown."""
        try:
            state = current_state()
            body = self._encoder.op_body(trace_id, span_id, parent.span_id if parent is not None else None, state, tid)
            lock = self._lock
            if not lock.acquire(False) and not self._wait_lock("an op's start"):
                return  # its span, begun later, is written whole then
            try:
                if self._sealed:
                    return
                seq = self._seq + 1
                line = self._encoder.op_start(name, body, seq, start_ns, attrs)
                self._seq = seq
                self._arrived[span_id] = ((name, attrs, start_ns, parent, trace_id), (body, state, tid))
                self._write(line)
            finally:
                lock.release()
        except Exception as exc:
            self._fault("an op's start", exc)

    def _adopt(self, span: Any) -> bool:
        # Called with the lock held: a span whose start arrival() wrote is open now; nothing is written.
        entry = self._arrived.pop(span._context.span_id, None)
        if entry is None:
            return False
        if type(span) is not LeanSpan and not getattr(span, "_runtime_clock", False):
            span._start_time = from_wall(span._start_time)  # as span_start would have: on the records' clock
        self._open[span._context.span_id] = (span, *entry[1])
        return True

    def on_end(self, span: ReadableSpan) -> None:
        try:
            lock = self._lock
            if not lock.acquire(False) and not self._wait_lock("a span end"):
                self._open.pop(span._context.span_id, None)  # its start is in the file: a reader sees it open
                return
            try:
                span_id = span._context.span_id
                entry = self._open.get(span_id)
                if entry is None:
                    if span_id in self._unwritten:
                        self._unwritten.discard(span_id)
                        self.stall_dropped += 1
                        return
                    self._end_record(span, None, incomplete=False)
                else:  # the common case, inline: it runs for every span
                    # Queued before it leaves the open table, so that a look at the table (one dict copy,
                    # no lock) finds every span either open or queued: the watchdog times a parent from
                    # its children's ends, the comm recorder parents ops by the spans they ran in.
                    ended, closed = self.ended, self.closed_entries
                    if ended is not None:
                        ended.append(span)
                    if closed is not None:
                        closed.append(entry)
                    del self._open[span_id]
                    seq = self._seq + 1
                    line = self._encoder.span_end(span, entry[1], seq, state=entry[2])
                    self._seq = seq
                    self._write(line)
            finally:
                lock.release()
        except Exception as exc:
            self._fault("a span end", exc)

    def _end_record(self, span: Any, entry: OpenEntry | None, *, incomplete: bool) -> None:
        # Called with the lock held.
        if entry is None:
            if self._sealed:
                return  # already ended as incomplete by shutdown
            # A span that started before this processor existed gets its body now.
            body = self._encoder.span_body(span, current_state(), get_native_id())
        else:
            body = entry[1]
        seq = self._seq + 1
        line = self._encoder.span_end(span, body, seq, incomplete=incomplete,
                                      state=entry[2] if entry is not None else current_state())
        self._seq = seq
        self._write(line)

    def instant(self, name: str, attrs: Mapping[str, Any] | None = None) -> None:
        """Write an ``instant`` record inside the caller's current span and step."""
        self._point("an instant", self._encoder.instant, name=name, attrs=attrs)

    def scalar(self, values: Mapping[str, Any]) -> None:
        """Write a ``scalar`` record inside the caller's current span and step."""
        self._point("a scalar", self._encoder.scalar, values=values)

    def instant_for(self, name: str, attrs: Mapping[str, Any], span_id: int | None = None) -> None:
        """Write an instant on the runtime's own behalf (no caller; the watchdog's records): inside the
        open span ``span_id`` with its ids, step context and thread, or outside any span at the latest step."""
        try:
            entry = self._open.get(span_id) if span_id is not None else None
            if entry is not None:
                ids, state, tid = entry[0]._context, entry[2], entry[3]
            else:
                ids, state, tid = INVALID_SPAN_CONTEXT, current_state(), get_native_id()
            self._emit_point(self._encoder.instant, ids, state, tid, "", {"name": name, "attrs": attrs},
                             wait_s=RUNTIME_LOCK_WAIT_S)
        except Exception as exc:
            self._fault(f"a {name}", exc)

    def open_spans(self) -> list[tuple[int, str, int, int]]:
        """(span id, name, start ns, native thread id) of every open span, in start order.

        For the watchdog's thread: one dict copy (a single C call under the GIL), no lock.
        """
        return [(sid, entry[0]._name, entry[0]._start_time, entry[3]) for sid, entry in self._open.copy().items()]

    def open_entries(self) -> list[OpenEntry]:
        """Every open span's (span, body, step context, native thread id), in start order (one dict copy, no lock)."""
        return list(self._open.copy().values())

    def digest_point(self, wait_s: float = RUNTIME_LOCK_WAIT_S) -> tuple[int, tuple[int, int], list[OpenEntry]] | None:
        """(seq, the file's (inode, size), the open spans) at one instant, for a digest: taken under the
        write lock (waiting at most ``wait_s``), so the open spans are exactly those the file shows open
        at that size (every record up to ``seq`` is in the kernel). None without a file, or while the
        writer is stalled."""
        if self._writer_stalled():
            return None  # the lock is held by a write that does not return: no digest until it does
        if not self._lock.acquire(timeout=wait_s):
            raise TimeoutError(f"a record write held the trace file for over {wait_s:g} s")
        try:
            position = self._writer.position() if self._writer is not None and not self._closed else None
            return None if position is None else (self._seq, position, list(self._open.values()))
        finally:
            self._lock.release()

    def _point(self, what: str, encode: Callable[..., bytes], **payload: Any) -> None:
        try:
            ids = get_current_span().get_span_context()
            caller = self._caller() if self._caller is not None else ""
            self._emit_point(encode, ids, current_state(), get_native_id(), caller, payload)
        except Exception as exc:
            self._fault(what, exc)

    def _emit_point(self, encode: Callable[..., bytes], ids: Any, state: StepState, tid: int, caller: str,
                    payload: Mapping[str, Any], wait_s: float = -1) -> None:
        # wait_s >= 0: give up (TimeoutError) rather than wait longer for a write in progress.
        if wait_s >= 0:
            if not self._lock.acquire(timeout=wait_s):
                raise TimeoutError(f"a record write held the trace file for over {wait_s:g} s")
        elif not self._entered("an instant or scalar"):
            return
        try:
            if self._closed:
                return
            seq = self._seq + 1
            line = encode(ts_ns=time_ns(), ids=ids, state=state, tid=tid, seq=seq, caller=caller, **payload)
            self._seq = seq
            self._write(line)
        finally:
            self._lock.release()

    def _on_loss(self, lost_records: int, lost_bytes: int, reason: str) -> None:
        # The writer found its file gone and made a new one: say so in the new file at once, so a
        # reader of it knows what came before is missing (the total is also in process_end).
        self.instant(S.INSTANT_WRITE_ERRORS, {"lost_records": lost_records, "lost_bytes": lost_bytes,
                                              "reason": reason})

    def _on_notice(self, attrs: Mapping[str, Any]) -> None:
        # The storage answered again after a stall: how long it stalled and what was dropped meanwhile.
        dropped, self._stall_dropped_since = self.stall_dropped - self._stall_dropped_since, self.stall_dropped
        self.instant(S.INSTANT_WRITE_ERRORS, {**attrs, "dropped_records": dropped})

    def _write(self, line: bytes) -> None:
        # Called with the lock held, so seq order is file order. Handlers first: a write may add a
        # notice record of its own (see _on_loss), which must reach them after this one.
        if self._closed:
            return
        if self._redact is not None:
            line = self._redact(line)
        if self._handlers:
            self._hand_over(_decode(line))
        if self._writer is not None:
            self._writer.write(line)

    def _hand_over(self, record: dict) -> None:
        for handler in self._handlers:
            try:
                handler(record)
            except Exception as exc:
                _report.report_exception(f"record handler {getattr(handler, '__qualname__', handler)!r}", exc)

    def end_open_spans(self) -> int:
        """End every still-open span with status ``incomplete`` (innermost first); returns how many.

        From here on no new span is written (instants still are, until :meth:`finish`). Waits for the lock
        as a record does (bounded by :meth:`finish_by`); without it, returns 0 and writes nothing.
        """
        if not self._entered("shutdown's incomplete ends"):
            self._sealed = True
            return 0
        with _Held(self._lock):
            self._sealed = True
            for span_id, ((name, attrs, start_ns, parent, trace_id), rest) in self._arrived.items():
                # an op whose span never began: ended here like any open span
                span = LeanSpan(name, SpanContext(trace_id, span_id, False, _SAMPLED), parent, attrs, None)
                span._start_time = start_ns
                self._open[span_id] = (span, *rest)
            self._arrived.clear()
            entries = list(reversed(self._open.items()))
            for span_id, (span, *_) in entries:
                self._end_incomplete(span)
                entry = self._open.pop(span_id, None)
                if entry is not None:
                    # Its end() did not reach on_end: it was already ending when shutdown came (on
                    # another thread, or on this one, interrupted by a signal), or end() failed.
                    # Write the end ourselves: as it ended, if it has an end time, else incomplete.
                    try:
                        self._end_record(span, entry, incomplete=span._end_time is None)
                    except Exception as exc:
                        self._fault("a span end", exc)
        return len(entries)

    def _end_incomplete(self, span: Any) -> None:
        if span._end_time is not None:
            return  # ending on another thread right now, its on_end waiting for our lock: see above
        # An SDK span takes its own lock in set_attribute and end(). Other threads release it within
        # microseconds, but the main thread a SIGTERM interrupted inside it holds it while its handler
        # waits for this shutdown (otel_train/sigterm.py): such a span is left to the fallback above.
        span_lock = getattr(span, "_lock", None)
        if span_lock is not None:
            if not span_lock.acquire(timeout=0.1):
                return
            span_lock.release()
        try:
            span.set_attribute(INCOMPLETE_ATTR, True)
            span.end()
        except Exception as exc:
            _report.report_exception("ending an open span", exc)  # the fallback still writes its end

    def finish(self, name: str, attrs: Callable[[int, int], Mapping[str, Any]]) -> None:
        """Write the last record, an instant ``name`` with ``attrs(seq, dropped_records)``, then close.

        One lock hold: no record of any thread can come after it. Without the lock (a stalled write
        holds it past shutdown's deadline) nothing is written: the storage does not answer.
        """
        if not self._entered("process_end"):
            return
        with _Held(self._lock):
            if self._closed:
                return
            self._check_file()
            self.instant(name, attrs(self._seq + 1, self.dropped_records))
            self.shutdown()

    def _check_file(self) -> None:
        # The last look at the file before its last record: a file deleted since the writer's last
        # periodic check (less than a second ago) is found, reported and announced like one it found.
        check = getattr(self._writer, "check_now", None)
        lost = check() if check is not None else None
        if lost:
            self._on_loss(lost[0], lost[1], "trace file deleted")

    def shutdown(self) -> None:
        if not self._entered("the file's close"):
            return
        with _Held(self._lock):
            if self._closed:
                return
            self._closed = self._sealed = True
            if self._writer is not None:
                self._writer.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        # Every record is in the kernel by the time _write returns: nothing to flush.
        return True

    def _fault(self, what: str, exc: BaseException) -> None:
        self.unencodable += 1
        _report.report_exception(f"writing {what} record", exc)


class _Held:
    """Releases a lock already taken, at the end of a ``with`` block."""

    __slots__ = ("_lock",)

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
