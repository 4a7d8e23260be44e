"""The recorder: a daemon thread that turns notes and Flight Recorder entries into ``comm.*`` spans.

Every :data:`POLL_S` it (docs/comm.md, "Recording"):

1. reads each group's op counter (before taking the notes: an op counted here has its note queued);
2. takes the queued notes and, for each, writes its group's ``comm.group`` instant once, then starts
   its span through the runtime's tracer with the op's own start time, inside the context the op was
   issued in (so the span is a child of the issuing span and carries that step) and on behalf of the
   issuing thread (its ``tid``); a note that already ended is ended at once with its end time, one
   still running stays an open span (its start record is in the file: a rank waiting in the op);
3. ends the spans of running ops that finished since (a future's callback stamped them, or a Work
   without a future now ``is_completed()``);
4. when a counter ran past the notes (ops issued from C++ or by functional collectives), reads the
   Flight Recorder buffer and writes a span for each entry no note covers (``comm.source``:
   ``flight_recorder``); one op is one span, never two.

Records written late carry the event's time in ``ts`` (readers order by ``seq``). ``flush`` writes
everything queued; :meth:`Recorder.stop` stops the thread and flushes (shutdown, SIGTERM).
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanKind, Status, StatusCode

from otel_train.record_clock import from_foreign, now_ns  # the runtime's one clock (docs/clock.md)
from otel_train import _report
from otel_train._threads import Worker
from otel_train import context as step_context
from otel_train import schema as S
from otel_train.comm import flight_recorder as fr
from otel_train.comm.groups import GroupState, GroupTable
from otel_train.comm.herald import Herald, span_attrs
from otel_train.comm.notes import Note, NoteQueue
from otel_train.comm.patch import PENDING
from otel_train.exporters.jsonl.processor import on_behalf

POLL_S = 0.2
"""How often the thread looks: a rank waiting in an op shows as an open span within about this long."""
MAX_GAPS = 4096
HISTORY_NS = 10_000_000_000
"""Spans that ended this long ago are forgotten even while an op of the buffer is unread (reads come at
most :data:`flight_recorder.MAX_READ_INTERVAL_S` apart)."""
MARGIN_NS = 100_000_000
"""Spans that ended this long before the last look that left no op unread are kept anyway (clock slack)."""
STEP_HISTORY = 1024
PAUSE_SLICE_S = 0.02
"""The recorder thread's sleeps between looks come in slices this long: a stop is seen within one."""
FR_SETTLE_S = 0.3
"""At a final look (``destroy_process_group``, shutdown), how long buffer ops still running are read
again to see them end: gloo marks an op completed from its own thread a few ms after its result was
used (up to 6 ms measured on a quiet machine; longer on a loaded one), so a clean exit read at once
ended a finished op as ``incomplete``. An op that is really stuck costs a final look this much."""
FR_SETTLE_FIRST_S = 0.002
"""The first pause between those reads; each next one twice as long (a read costs about a ms)."""
SOURCE_FR = "flight_recorder"
ATTR_SOURCE = "comm.source"
_INTERNAL = SpanKind.INTERNAL


class Recorder:
    """The thread and its state; :meth:`poll` is one look (tests call it)."""

    def __init__(self, tracer: trace.Tracer, queue: NoteQueue, groups: GroupTable, *,
                 instant: Callable[[str, dict[str, Any]], None], open_entries: Callable[[], list[Any]] | None = None,
                 buffer: fr.BufferReader | None = None, poll_s: float = POLL_S,
                 closed: deque[Any] | None = None, herald: Herald | None = None) -> None:
        self._tracer = tracer
        self._herald = herald  # wrote the start records of the notes it saw: their spans take its ids
        self._queue = queue
        self._groups = groups
        self._instant = instant
        self._open_entries = open_entries
        self._buffer = buffer
        self.poll_s = poll_s
        self._running: list[tuple[Note, Any]] = []  # (note, span) of ops still in progress
        self._fr_open: dict[tuple[str, int], Any] = {}  # Flight Recorder ops still running: their spans
        # A Flight Recorder op's parent is the innermost span open on its thread when it was issued: every
        # span seen open at a look, or handed over by ``closed`` (the processor appends each span's entry
        # as it ends), span id -> entry, kept until it ended before any op still unread was issued.
        self._closed = closed
        self._spans: dict[int, Any] = {}
        self._horizon_ns = 0
        # (time, step context) at each step change: the step of a Flight Recorder op without a parent.
        self._step_times: list[int] = []
        self._step_states: list[Any] = []
        self._lock = threading.Lock()
        self._worker = Worker("otel-train-comm", self._run, drain=lambda timeout_s: self.poll(final=True, wait_s=timeout_s))
        self._last_counts: tuple[int, ...] | None = None  # the groups' op counters at the previous look
        self._read_counts: tuple[int, ...] | None = None  # ... at the last read of the buffer
        self.spans = 0
        self.fr_spans = 0
        self.fr_lost = 0

    def start(self) -> Recorder:
        self._worker.start()
        return self

    def on_step(self, step: int) -> None:
        """A step listener (the training thread, once per step): remember when each step began."""
        times, states = self._step_times, self._step_states
        times.append(now_ns())
        states.append(step_context.current())
        if len(times) > 2 * STEP_HISTORY:  # keep the latest STEP_HISTORY (the recorder reads both lists)
            self._step_times, self._step_states = times[-STEP_HISTORY:], states[-STEP_HISTORY:]

    def _step_at(self, ns: int) -> Any:
        times, states = self._step_times, self._step_states
        index = bisect.bisect_right(times, ns, 0, min(len(times), len(states))) - 1
        return states[index] if index >= 0 else None

    def baseline(self) -> None:
        """Ops the groups that exist now issued before recording began are not the recorder's to write."""
        if self._buffer is None or not self._buffer.enabled:
            return
        for state, counter in self._counters():
            state.last_fr_key = max(state.last_fr_key, counter)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the thread, then write whatever is queued (ops still running stay open spans)."""
        self._worker.stop(timeout_s)

    def flush(self, wait_s: float = 1.0) -> None:
        """Write everything queued and read the Flight Recorder buffer now (before its groups go away)."""
        self.poll(final=True, wait_s=wait_s)

    def _run(self) -> None:
        # Short relative sleeps, not Event.wait: a timed wait on an absolute deadline never returned in a
        # process whose clocks libfaketime offsets (the recorder then wrote no span until the final flush,
        # tests/test_clock_torchrun.py); a stop is seen within a slice.
        while not self._worker.pause(self.poll_s, PAUSE_SLICE_S):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the recorder keeps looking; training never hears of it
                _report.report_exception("comm recorder", exc)

    def poll(self, *, final: bool = False, wait_s: float = -1) -> None:
        """One look (see the module doc)."""
        if not self._lock.acquire(timeout=wait_s):
            return
        try:
            look_ns = now_ns()
            counters = self._counters() if self._buffer is not None and self._buffer.enabled else None
            self._announce_groups()
            for note in self._queue.take():
                try:
                    self._begin(note)
                except Exception as exc:  # noqa: BLE001 - one op unrecorded, the others still are
                    _report.report_exception("writing a comm span", exc)
            self._end_finished()
            if counters is not None:
                self._see_spans()
                self._note_gaps(counters)
                now = time.monotonic()
                stopped = self._stopped(counters) and self._buffer.due_when_stopped(now)
                if (final or stopped or self._buffer.due(now)) and (self._fr_open or self._has_gaps()):
                    self._read_counts = self._last_counts
                    self._read_buffer(now)
                    if final:
                        self._settle(now + FR_SETTLE_S)
                self._forget_spans(look_ns)
        finally:
            self._lock.release()

    def _stopped(self, counters: list[tuple[GroupState, int]]) -> bool:
        """Whether the groups issued no op since the previous look, and the buffer was not read since they
        last did: a rank that stopped issuing ops may be waiting in the last one, whose span (a buffer-only
        op: a functional collective) is then written at this look, not at the paced read's (docs/comm.md)."""
        counts = tuple(counter for _, counter in counters)
        stopped = counts == self._last_counts and counts != self._read_counts
        self._last_counts = counts
        return stopped

    def _announce_groups(self) -> None:
        """A ``comm.group`` instant for each group this process is in, at the first look that finds it
        (so near the head of the file, where ``summarize --fast`` reads the layout); a group whose
        first op comes before that look is announced by the op's note (``_begin``)."""
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None:
            return
        for pg in list(c10d._world.pg_names):
            state = self._groups.get(pg)
            if state is None:
                try:
                    state = self._groups.add(pg)
                except Exception:  # noqa: BLE001 - a group torch cannot describe yet: its first op will
                    continue
            if not state.announced:
                state.announced = True
                self._instant(S.INSTANT_COMM_GROUP, state.instant_attrs())

    # Notes -> spans

    def _begin(self, note: Note) -> None:
        state = note.group
        if note.fr_key is not None and self._buffer is not None and self._buffer.enabled:
            self._covered(state, note.fr_key)
        if not state.announced:
            state.announced = True
            note.ctx.run(self._announce_in, state, note.start_ns)
        attrs = span_attrs(note.op, state.name, note.seq, note.peer, note.nbytes, note.dtype)
        if self._herald is not None:
            self._herald.adopt(note)
        span = self._start_span(note.ctx, S.comm_span_name(note.op), attrs, note.start_ns, note.tid)
        if note.end_ns or self._work_done(note):
            self._end(span, note.end_ns, note.error)
        else:
            self._running.append((note, span))

    def _start_span(self, ctx: Any, name: str, attrs: dict[str, Any], start_ns: int, tid: int) -> Any:
        on_behalf.tid = tid
        try:
            span = ctx.run(self._start_in, name, attrs, start_ns)
        finally:
            on_behalf.tid = None
        self.spans += 1
        return span

    def _start_in(self, name: str, attrs: dict[str, Any], start_ns: int) -> Any:
        """In the op's context: a thread that never set a step sees the step current when the op was
        issued (what it would have seen then), not the one current now."""
        self._pin_step(start_ns)
        return self._tracer.start_span(name, None, _INTERNAL, attrs, None, start_ns)

    def _pin_step(self, ns: int) -> None:
        if step_context._current.get() is None:
            step_context._current.set(self._step_at(ns) or step_context.EMPTY)

    def _announce_in(self, state: GroupState, ns: int) -> None:
        self._pin_step(ns)
        self._instant(S.INSTANT_COMM_GROUP, state.instant_attrs())

    @staticmethod
    def _work_done(note: Note) -> bool:
        work = note.work
        if work is None:
            return False
        try:
            done = work.is_completed()
        except Exception:  # noqa: BLE001 - a Work that cannot say: end it now
            done = True
        if done:
            PENDING.pop(id(work), None)
            if not note.end_ns:
                note.done()
        return done

    @staticmethod
    def _end(span: Any, end_ns: int, error: str | None) -> None:
        if error is not None:
            kind, _, message = error.partition(": ")
            span.add_event("exception", {"exception.type": kind, "exception.message": message})
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(end_ns, getattr(span, "_start_time", 0) or 0))

    def _end_finished(self) -> None:
        still = []
        for note, span in self._running:
            if note.end_ns or self._work_done(note):
                if note.op == "recv" and note.peer is not None:  # from any source: known once it returned
                    span.set_attribute(S.ATTR_COMM_PEER, note.peer)
                    span.set_attribute(S.ATTR_COMM_SEQ, note.seq)
                self._end(span, note.end_ns, note.error)
            else:
                still.append((note, span))
        self._running = still

    # Flight Recorder: ops no note covers

    def _counters(self) -> list[tuple[GroupState, int]]:
        out = []
        from torch.distributed import distributed_c10d as c10d

        for pg in list(c10d._world.pg_names):
            try:
                state = self._groups.get(pg) or self._groups.add(pg)
                out.append((state, state.counter()))
            except Exception:  # noqa: BLE001 - a group of a backend without a counter
                continue
        return out

    def _covered(self, state: GroupState, key: int) -> None:
        last = state.last_fr_key
        if key > last + 1:
            self._add_gap(state, last + 1, key - 1)
        if key > last:
            state.last_fr_key = key
        elif state.gaps:
            self._take(state, key)

    def _note_gaps(self, counters: list[tuple[GroupState, int]]) -> None:
        for state, counter in counters:
            if counter > state.last_fr_key:
                self._add_gap(state, state.last_fr_key + 1, counter)
                state.last_fr_key = counter

    @staticmethod
    def _add_gap(state: GroupState, lo: int, hi: int) -> None:
        state.gaps.append((lo, hi))
        if len(state.gaps) > MAX_GAPS:
            del state.gaps[0]

    @staticmethod
    def _take(state: GroupState, key: int) -> bool:
        """Remove ``key`` from the group's gaps; whether it was in one."""
        for i, (lo, hi) in enumerate(state.gaps):
            if lo <= key <= hi:
                state.gaps[i:i + 1] = [g for g in ((lo, key - 1), (key + 1, hi)) if g[0] <= g[1]]
                return True
        return False

    def _has_gaps(self) -> bool:
        return any(state.gaps for state in self._groups.states())

    def _read_buffer(self, now: float) -> None:
        entries = self._buffer.read(now)
        if not entries:
            return
        fresh = self._buffer.new(entries)
        by_name = {state.name: state for state in self._groups.states()}
        if self._fr_open:
            self._end_fr_open(entries, by_name)
        threads = {t.ident: t.native_id for t in threading.enumerate()}
        self._see_spans()
        for entry in fresh:
            group = entry.get("process_group") or ("",)
            state = by_name.get(str(group[0]))
            op = fr.entry_op(entry)
            if state is None or op is None:
                continue
            key = int(entry["op_id"] if state.op_counts_p2p else entry["collective_seq_id"])
            if self._take(state, key):
                self._fr_span(entry, state, op, key, threads)
        self._count_lost(entries, by_name)

    def _settle(self, deadline: float) -> None:
        """Read the buffer again until its ops still open are seen to end, or the (monotonic) deadline:
        each pause is followed by a read, so the last read comes at or after the deadline."""
        pause = FR_SETTLE_FIRST_S
        while self._fr_open and self._buffer is not None and self._buffer.enabled:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(pause, left))
            pause *= 2
            self._read_buffer(time.monotonic())

    def _see_spans(self) -> None:
        """Take the spans open now, then those that ended since the last look (in this order: a span the
        first misses had ended, so the second has it)."""
        spans = self._spans
        if self._open_entries is not None:
            for entry in self._open_entries():
                spans.setdefault(entry[0]._context.span_id, entry)
        closed = self._closed
        if closed is not None:
            if closed.maxlen is not None and len(closed) >= closed.maxlen:
                _report.report("comm.closed_spans_dropped", "the comm recorder fell behind: the oldest ended spans "
                               "it places Flight Recorder ops under were dropped (some comm.* spans may have a "
                               "coarser parent)")
            pop = closed.popleft
            for _ in range(len(closed)):
                entry = pop()
                spans[entry[0]._context.span_id] = entry

    def _forget_spans(self, look_ns: int) -> None:
        """Forget spans that ended before any op the buffer may still hand over was issued: with no op
        unread, every op to come was issued after this look began."""
        if not self._has_gaps():
            self._horizon_ns = look_ns - MARGIN_NS
        horizon = max(self._horizon_ns, now_ns() - HISTORY_NS)
        spans = self._spans
        for span_id in [k for k, e in spans.items() if (e[0]._end_time or horizon) < horizon]:
            del spans[span_id]

    def _fr_span(self, entry: dict[str, Any], state: GroupState, op: str, key: int, threads: dict[Any, Any]) -> None:
        start = from_foreign(int(entry.get("time_created_ns") or 0)) if entry.get("time_created_ns") else now_ns()
        tid = _native_tid(entry, threads)
        parent = _parent_of(list(self._spans.values()), tid, start)
        ctx = _context_for(parent, self._step_at(start))
        if not state.announced:
            state.announced = True
            ctx.run(self._announce_in, state, start)
        nbytes, dtype = fr.entry_bytes(entry)
        attrs = span_attrs(op, state.name, int(entry.get("collective_seq_id") or 0), None, nbytes, dtype)
        attrs[ATTR_SOURCE] = SOURCE_FR
        span = self._start_span(ctx, S.comm_span_name(op), attrs, start, tid or 0)
        self.fr_spans += 1
        if fr.entry_done(entry):
            self._end(span, from_foreign(int(entry["time_discovered_completed_ns"])) if entry.get("time_discovered_completed_ns") else start, None)
        else:
            self._fr_open[(state.name, key)] = span

    def _end_fr_open(self, entries: list[dict[str, Any]], by_name: dict[str, GroupState]) -> None:
        now = now_ns()
        for entry in entries:
            group = entry.get("process_group") or ("",)
            state = by_name.get(str(group[0]))
            if state is None:
                continue
            key = int(entry["op_id"] if state.op_counts_p2p else entry["collective_seq_id"])
            span = self._fr_open.get((state.name, key))
            if span is not None and fr.entry_done(entry):
                del self._fr_open[(state.name, key)]
                self._end(span, from_foreign(int(entry["time_discovered_completed_ns"])) if entry.get("time_discovered_completed_ns") else now, None)

    def _count_lost(self, entries: list[dict[str, Any]], by_name: dict[str, GroupState]) -> None:
        """Gaps below the oldest entry of their group are ops the buffer no longer holds."""
        oldest: dict[str, int] = {}
        for entry in entries:
            group = str((entry.get("process_group") or ("",))[0])
            state = by_name.get(group)
            if state is not None and group not in oldest:
                oldest[group] = int(entry["op_id"] if state.op_counts_p2p else entry["collective_seq_id"])
        before = self.fr_lost
        for group, first in oldest.items():
            state = by_name[group]
            kept = []
            for lo, hi in state.gaps:
                if hi < first:
                    self.fr_lost += hi - lo + 1
                elif lo < first:
                    self.fr_lost += first - lo
                    kept.append((first, hi))
                else:
                    kept.append((lo, hi))
            state.gaps = kept
        if self.fr_lost > before:  # nothing lost silently: reported once, every lost op counted
            _report.report("comm.flight_recorder_lost",
                           "ops issued from C++ left the Flight Recorder buffer before the recorder read them "
                           "(no comm.* span for them; a larger TORCH_FR_BUFFER_SIZE keeps more)",
                           self.fr_lost - before)


def _native_tid(entry: dict[str, Any], threads: dict[Any, Any]) -> int | None:
    try:
        return threads.get(int(entry.get("thread_id") or 0))
    except (TypeError, ValueError):
        return None


def _parent_of(entries: list[Any], tid: int | None, start_ns: int) -> Any:
    """The innermost span open on thread ``tid`` at ``start_ns`` (started before it, not ended before it),
    other than an op (an op never holds another; a buffer op still running is open on that thread too):
    (span, state) or None."""
    best = None
    for span, _, state, span_tid in entries:
        if span_tid != tid or span._start_time > start_ns or span._name.startswith(S.COMM_PREFIX):
            continue
        end = span._end_time
        if end is not None and end < start_ns:
            continue
        if best is None or span._start_time >= best[0]._start_time:
            best = (span, state)
    return best


def _context_for(parent: Any, state: Any = None) -> Any:
    """A contextvars context whose current span is ``parent``'s and whose step is its step (else ``state``)."""
    import contextvars

    from opentelemetry import context as otel_context

    ctx = contextvars.Context()

    def enter() -> None:
        if parent is not None:
            otel_context.attach(trace.set_span_in_context(NonRecordingSpan(parent[0].get_span_context())))
            step_context._current.set(parent[1])
        elif state is not None:
            step_context._current.set(state)

    ctx.run(enter)
    return ctx
