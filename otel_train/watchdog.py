"""The watchdog: one daemon thread per traced process that writes ``heartbeat`` and ``stall`` instants.

Why a thread: a rank that hangs writes nothing, and a reader cannot tell "stuck" from "busy" without
knowing how long each phase usually takes. The hot path already knows which spans are open (the JSONL
processor keeps them until they end); this thread looks at that set about once a second and writes
(docs/watch.md):

* ``heartbeat`` when the process has written nothing for ``heartbeat_s``; attrs ``open``: the open
  span names of every thread, outermost first. A reader tells a quiet process from a dead one by it.
* ``stall`` when the innermost open span of a thread has been open longer than its threshold
  (``otel_train.stall``: ``max(stall_min_s, stall_factor × p99 of that name so far)``) and the
  innermost for at least ``stall_min_s``; again each time its open time doubles, at most 6 times per
  span. It carries the span's ids, step context and thread, and every thread's Python stack.

Only the innermost open span of each thread is judged: a ``step`` that is long because its
``checkpoint`` is long (and within the checkpoint's own threshold) is not a stall. And a span is
judged only once it has been the innermost for ``stall_min_s`` (the least threshold of any span), since
the later of its start and the end of its last child span: in the moment between a long checkpoint's
end and its step's end, the step is innermost and long open, and it is no stall either. A thread
stuck in a parent's own code (between two steps, in ``train``) is still named ``stall_min_s`` after
its last child ended.

Costs on the hot path: one deque append of the span at its end; the thread counts those spans
into a per-name duration sketch (:class:`DurationSketch`, O(1) per span). It reads the processor's
record count instead of a timestamp per write, copies the open-span table (one C-level dict copy
under the GIL, no lock) and takes the processor's write lock only to write its own records. It never
touches torch, never blocks training, and reports its own faults through ``otel_train._report``.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable
import threading
import time
from types import FrameType
from typing import Any, Protocol

from otel_train import record_clock, _report, sketch
from otel_train._threads import Worker
from otel_train.digest import DigestWriter
from otel_train import schema as S
from otel_train.stall import MAX_STALLS_PER_SPAN, stall_threshold

MAX_FRAMES = 64
"""Innermost frames kept per thread in a stall record."""
MAX_TICK_S = 1.0
"""The thread looks at least this often (more often when heartbeat_s or stall_min_s is short)."""
MAX_QUEUED_SPANS = 8192
"""Ended spans kept for the next look; beyond, the oldest are dropped: above ~8,000 spans a second the
sketch counts a sample, which bounds what counting costs the process (it holds the GIL) per look."""

MAX_NAMES = 1024
"""Span names whose durations a process tracks one by one (the bucket included). Each costs ~18 KB
(``sketch.BUCKETS`` counts), so the cap bounds the sketch at ~18 MB whatever the names; the spans of
names past it are counted together under :data:`OTHER_NAMES` (docs/schema.md, "Digests")."""
OTHER_NAMES = "otel_train.other_names"
"""The bucket of the names past :data:`MAX_NAMES`, as a digest's ``phases`` shows it."""

_log = math.log


class DurationSketch:
    """Closed-span durations per name, as log-spaced bucket counts (``otel_train.sketch``: ±1 % relative),
    with each name's total and longest duration.

    ``add`` is one dict lookup, one logarithm and one list slot bumped; the watchdog's thread calls it
    (through :meth:`count`), :meth:`quantile` and :meth:`snapshot` (for the digest), which read copies.
    """

    __slots__ = ("_buckets", "_totals", "folded")

    def __init__(self) -> None:
        self._buckets: dict[str, list[int]] = {}
        self._totals: dict[str, list[int]] = {}  # name -> [sum ns, max ns]
        self.folded = 0
        """Spans counted under :data:`OTHER_NAMES` because their name came past the cap."""

    def _slots(self, name: str) -> tuple[list[int], list[int]]:
        counts = self._buckets.get(name)
        if counts is None:
            if len(self._buckets) >= MAX_NAMES - 1:  # one slot of the cap is the bucket's
                return self._fold()
            counts = self._buckets[name] = [0] * sketch.BUCKETS
            self._totals[name] = [0, 0]
        return counts, self._totals[name]

    def _fold(self) -> tuple[list[int], list[int]]:
        counts = self._buckets.get(OTHER_NAMES)
        if counts is None:
            counts = self._buckets[OTHER_NAMES] = [0] * sketch.BUCKETS
            self._totals[OTHER_NAMES] = [0, 0]
            _report.report("span names past the cap",
                           f"more than {MAX_NAMES - 1} distinct span names in this process: the durations of "
                           f"the rest are counted together as {OTHER_NAMES!r} (in the digest), and their stall "
                           "threshold is stall_min_s x stall_factor; the trace file keeps every span")
        self.folded += 1
        return counts, self._totals[OTHER_NAMES]

    def add(self, name: str, dur_ns: int) -> None:
        """Count one closed span of ``name`` that lasted ``dur_ns`` nanoseconds."""
        counts, totals = self._slots(name)
        counts[int(_log(dur_ns + 1) * sketch.INV_LOG_GAMMA)] += 1
        totals[0] += dur_ns
        if dur_ns > totals[1]:
            totals[1] = dur_ns

    def count(self, ended: Iterable[Any]) -> None:
        """Count every span of ``ended`` (objects with ``_name``, ``_start_time``, ``_end_time``)."""
        log, inv = _log, sketch.INV_LOG_GAMMA
        last, counts, totals = None, None, None
        for span in ended:
            if span._name is not last:
                last = span._name
                counts, totals = self._slots(last)
            elif last not in self._buckets:  # a run of one name past the cap: each span is counted
                self.folded += 1
            dur = span._end_time - span._start_time
            counts[int(log(dur + 1) * inv)] += 1  # type: ignore[index]
            totals[0] += dur  # type: ignore[index]
            if dur > totals[1]:  # type: ignore[index]
                totals[1] = dur  # type: ignore[index]

    def quantile(self, name: str, q: float) -> tuple[int, float | None]:
        """(count, the ``q`` quantile in seconds, or None without durations) of ``name`` so far."""
        counts = self._buckets.get(name)
        if counts is None or name == OTHER_NAMES:  # the bucket mixes names: no p99 of any one
            return 0, None
        total, index = sketch.quantile_index(enumerate(counts[:]), q)  # a C-level copy: consistent
        # The bucket's upper edge: a threshold errs on the late side, never on a false stall.
        return total, None if index is None else sketch.upper_ns(index) / 1e9

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every name's count, total and longest duration (ms) and its non-empty buckets (a digest's ``phases``)."""
        out = {}
        for name, counts in list(self._buckets.items()):
            counts = counts[:]
            sum_ns, max_ns = self._totals[name]
            out[name] = {"count": sum(counts), "sum_ms": sum_ns / 1e6, "max_ms": max_ns / 1e6,
                         "buckets": {str(i): c for i, c in enumerate(counts) if c}}
        return out


class InstantSink(Protocol):
    """What the watchdog needs from the JSONL processor."""

    @property
    def records_written(self) -> int: ...

    def open_spans(self) -> list[tuple[int, str, int, int]]: ...

    def instant_for(self, name: str, attrs: dict[str, Any], span_id: int | None = None) -> None: ...


def thread_stacks(skip_ident: int | None = None) -> list[dict[str, Any]]:
    """Every thread's Python stack: ``{"tid", "thread", "frames": ["path:line:function", …]}``, innermost last.

    ``tid`` is the native thread id (what records and py-spy show); threads not made by ``threading``
    show their Python ident. Reads no source files.
    """
    by_ident = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        thread = by_ident.get(ident)
        out.append({
            "tid": (thread.native_id if thread is not None else None) or ident,
            "thread": thread.name if thread is not None else f"thread-{ident}",
            "frames": _frames(frame),
        })
    return out


def _frames(frame: FrameType | None) -> list[str]:
    frames = []
    while frame is not None and len(frames) < MAX_FRAMES:
        code = frame.f_code
        frames.append(f"{code.co_filename}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    frames.reverse()
    return frames


class _Stall:
    __slots__ = ("threshold_s", "since_ns", "written")

    def __init__(self, threshold_s: float, since_ns: int) -> None:
        self.threshold_s = threshold_s
        self.since_ns = since_ns  # when the span became its thread's innermost (what it is judged from)
        self.written = 0


class Watchdog:
    """The thread: ``start()`` at init, ``stop()`` at shutdown; :meth:`check` is one look (tests call it)."""

    def __init__(self, sink: InstantSink, *, heartbeat_s: float, stall_min_s: float, stall_factor: float,
                 digest: DigestWriter | None = None) -> None:
        self._sink = sink
        self.digest = digest
        self.sketch = DurationSketch()
        # Spans that ended, appended by the hot path (one C call), counted at each look.
        self.ended: deque[Any] = deque(maxlen=MAX_QUEUED_SPANS)
        self._heartbeat_s = heartbeat_s
        self._stall_min_s = stall_min_s
        self._stall_factor = stall_factor
        periods = [p / 4 for p in (heartbeat_s, stall_min_s) if p > 0]
        self.tick_s = max(0.05, min([MAX_TICK_S, *periods]))
        self._worker = Worker("otel-train-watchdog", self._run)
        self._seen_seq = -1
        self._quiet_since = time.monotonic()
        self._wall_offset = record_clock.wall_offset_ns()  # the wall clock against the records' at the last look
        self._stalls: dict[int, _Stall] = {}
        self._child_ends: dict[int, int] = {}  # open span id -> the latest end (ns) of a span it parents, or 0
        # Called with the span's name after each stall record (the comm recorder dumps Flight Recorder).
        self.on_stall: Any = None
        # Called with each look's ended spans (profile_on's check, otel_train/profiling/triggers.py).
        self.on_look: Any = None

    def start(self) -> Watchdog:
        """Start the daemon thread (once)."""
        self._worker.start()
        return self

    def final_digest(self) -> None:
        """At shutdown, after the open spans ended: count what ended since the last look, write the digest."""
        if self.digest is not None:
            self.sketch.count(self._drain())
            self.digest.write(self._sink, self.sketch)  # type: ignore[arg-type]

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the thread; waits at most ``timeout_s`` for a look in progress to finish."""
        self._worker.stop(timeout_s)

    def _run(self) -> None:
        while not self._worker.sleep(self.tick_s):
            try:
                self.check()
            except Exception as exc:  # the watchdog keeps looking; training never hears of it
                _report.report_exception("watchdog", exc)

    def check(self) -> None:
        """One look: stall records for spans past their threshold, then a heartbeat if the process is quiet."""
        # The open spans first: a span the copy misses has ended, and the processor queued it in `ended`
        # before it left the table, so the drain after the copy has it (its end times its parent).
        open_spans = self._sink.open_spans()
        ended = self._drain()
        self.sketch.count(ended)
        if self.digest is not None:
            self.digest.maybe(self._sink, self.sketch)  # type: ignore[arg-type]
        self._check_clock()
        if self.on_look is not None:
            try:
                self.on_look(ended)
            except Exception as exc:  # noqa: BLE001 - the stall check below still runs
                _report.report_exception("watchdog look callback", exc)
        self._check_stalls(open_spans, ended, record_clock.now_ns())
        self._check_quiet(open_spans, time.monotonic())

    def _drain(self) -> list[Any]:
        """Every span queued in :attr:`ended` so far, removed from it (the hot path appends meanwhile)."""
        pop = self.ended.popleft
        return [pop() for _ in range(len(self.ended))]

    def _check_clock(self) -> None:
        """A ``clock_step`` instant when the wall clock moved away from the records' clock (docs/clock.md):
        by how much (``step_s``, since the last look; ``offset_s``, since the anchor), and the anchor."""
        offset = record_clock.wall_offset_ns()
        step, self._wall_offset = offset - self._wall_offset, offset
        if abs(step) <= record_clock.STEP_NS:
            return  # a slewing NTP moves the wall clock 0.5 ms a second at most: never this much between looks
        self._sink.instant_for(S.INSTANT_CLOCK_STEP, {
            "step_s": round(step / 1e9, 3), "offset_s": round(offset / 1e9, 3), "clock": record_clock.anchor()})

    def _innermost_since(self, open_spans: list[tuple[int, str, int, int]],
                         innermost: dict[int, tuple[int, str, int, int]], ended: list[Any]) -> dict[int, int]:
        """Each innermost span's id -> when it became innermost (ns): the later of its start and the
        latest end of a span it parents. Children's ends are kept for every open span, not only the
        innermost: a child may end between a look's copy of the table and its drain, and its parent is
        innermost only from the next look on."""
        ends = {sid: self._child_ends.get(sid, 0) for sid, _, _, _ in open_spans}
        for span in ended:
            parent = span._parent
            if parent is not None:
                end = ends.get(parent.span_id)
                if end is not None and span._end_time > end:
                    ends[parent.span_id] = span._end_time
        self._child_ends = ends
        return {sid: max(start, ends[sid]) for sid, _, start, _ in innermost.values()}

    def _check_quiet(self, open_spans: list[tuple[int, str, int, int]], now: float) -> None:
        seq = self._sink.records_written
        if seq != self._seen_seq:
            self._seen_seq, self._quiet_since = seq, now
            return
        if self._heartbeat_s and now - self._quiet_since >= self._heartbeat_s:
            by_thread: dict[int, list[str]] = {}
            for _, name, _, tid in sorted(open_spans, key=lambda s: s[2]):
                by_thread.setdefault(tid, []).append(name)
            self._sink.instant_for(S.INSTANT_HEARTBEAT, {"open": [{"tid": t, "spans": n} for t, n in by_thread.items()]})
            self._seen_seq, self._quiet_since = self._sink.records_written, now

    def _check_stalls(self, open_spans: list[tuple[int, str, int, int]], ended: list[Any], now_ns: int) -> None:
        innermost: dict[int, tuple[int, str, int, int]] = {}
        for span in open_spans:
            current = innermost.get(span[3])
            if current is None or span[2] >= current[2]:
                innermost[span[3]] = span
        since = self._innermost_since(open_spans, innermost, ended)
        for gone in [sid for sid in self._stalls if sid not in since]:
            del self._stalls[gone]
        for span_id, name, start_ns, tid in innermost.values():
            inner_s = (now_ns - since[span_id]) / 1e9
            if inner_s < self._stall_min_s:
                continue  # innermost for less than any threshold: just started, or its child just ended
            open_s = (now_ns - start_ns) / 1e9
            stall = self._stalls.get(span_id)
            if stall is None or since[span_id] > stall.since_ns:  # new, or a child ended since: judged afresh
                count, p99 = self.sketch.quantile(name, 0.99)
                threshold = stall_threshold(count, p99, self._stall_min_s, self._stall_factor)
                stall = self._stalls[span_id] = _Stall(threshold, since[span_id])
            if stall.written >= MAX_STALLS_PER_SPAN or open_s < stall.threshold_s * (2 ** stall.written):
                continue
            stall.written += 1
            self._sink.instant_for(S.INSTANT_STALL, {
                "span": name,
                "open_s": round(open_s, 3),
                "innermost_s": round(inner_s, 3),
                "threshold_s": round(stall.threshold_s, 3),
                "tid": tid,
                "stacks": thread_stacks(skip_ident=threading.get_ident()),
            }, span_id)
            if self.on_stall is not None:
                try:
                    self.on_stall(name)
                except Exception as exc:  # noqa: BLE001 - the next span is still judged
                    _report.report_exception("watchdog stall callback", exc)
