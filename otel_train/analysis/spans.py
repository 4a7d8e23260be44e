"""The span model: records paired into spans, one :class:`ProcessState` per process attempt.

This is the only place that knows how records make spans; every reader builds on it (summarize, stats,
findings, every export format, push and ``push --follow``, live ``watch``):

* a ``span_start`` and the ``span_end`` with the same ``span_id`` make one span (step: its start's);
* an end whose start is missing (it rotated away) is a span that started ``dur_ms`` before its end;
* a start without an end is *open* (the process died inside it, or is still inside it);
* an end with status ``incomplete`` (ended by shutdown) is *unclosed* like an open span; a ``comm.*``
  op whose parent had already ended is neither (its caller went on: closed at that end, or dropped);
* an end with status ``error`` is an error span;
* a ``process_end`` instant means the process ended through ``shutdown()`` (torchtitan's files: no span open);
* attempts come from the ``attempt`` field of a process's first records, numbered by start time
  when missing or claimed twice (:func:`assign_attempts`);
* the step window keeps spans, instants and scalars of the wanted steps, and step-less spans that
  overlap them in time (:func:`keep_steps`).

A :class:`ProcessState` is fed record batches in file order (:meth:`ProcessState.feed`): whole files in 1 MiB
batches, or what a tail of a growing file read since the last poll; both see the same state. It keeps
per-phase duration columns (what summaries need) and, with ``keep=True``, the spans, instants and scalars
themselves (what export and push need). Whether kept or not, every ``comm.*`` span (closed, open or
incomplete) is kept as a compact op (:class:`CommLog`, read as :class:`~otel_train.analysis.comm.CommOp`
by :meth:`ProcessState.comm_ops`), with the ``comm.group`` and ``otel_train.mesh`` instants: what
:mod:`otel_train.analysis.comm` matches across ranks (``Run.comm``). A name is checked for the ``comm.``
prefix once, when first seen (its sink), so a run without comm spans pays nothing for them.
"""

from __future__ import annotations

import contextvars
import gc
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec

from otel_train import schema
from otel_train.analysis.comm import SOURCE_TRACE, CommGraph, CommOp, Group, build_graphs
from otel_train.analysis.pools import pool_context
from otel_train.analysis.records import (
    AnyRecord,
    Head,
    Instant,
    ProcessFiles,
    Reader,
    Scalar,
    SpanEnd,
    SpanStart,
    TraceReadError,
    Warn,
    find_process_files,
    head,
    logs_dir,
    warn_to_stderr,
)
from otel_train.analysis.reading import types, window
from otel_train.analysis.reading.cache import Cache, identify
from otel_train.phases import STEP, STEP_PHASES

STATUS_OPEN = "open"
"""A span with a start record and no end record (the process died inside it, or is still inside)."""
UNCLOSED = (STATUS_OPEN, schema.STATUS_INCOMPLETE)

NO_STEP = -1
"""Step column value for a span recorded outside any step."""

PARALLEL_MIN_BYTES = 32 << 20
"""Runs at least this big are read by a process pool (below it, starting workers costs more than it saves)."""


class Span(msgspec.Struct, gc=False):
    """One span. ``end_ts`` is None while open; ``status``: ok, error, incomplete, or open.

    A msgspec Struct: a big run makes hundreds of thousands, and Struct construction is C code.
    """

    name: str
    span_id: str
    parent_span_id: str | None
    trace_id: str | None
    start_ts: float
    end_ts: float | None
    status: str
    tid: int | None
    step: int | None
    attrs: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    context: AnyRecord | None = None  # the start (or orphan end) record: step context, tags

    @property
    def dur_ms(self) -> float | None:
        """Duration in milliseconds, None while open."""
        return None if self.end_ts is None else (self.end_ts - self.start_ts) * 1000.0

    @property
    def unclosed(self) -> bool:
        """Still running when the process stopped: open, or ended as incomplete by shutdown."""
        return self.status in UNCLOSED


@dataclass(slots=True)
class PhaseSeries:
    """Closed spans of one name: parallel columns of step (``NO_STEP`` when none), ms, and end time."""

    steps: array = field(default_factory=lambda: array("q"))
    durs: array = field(default_factory=lambda: array("d"))
    ends: array = field(default_factory=lambda: array("d"))


@dataclass(slots=True)
class OpenSpan:
    """A span still running when the process stopped (or now): status ``open`` or ``incomplete``."""

    name: str
    span_id: str
    parent_span_id: str | None
    step: int | None
    start_ts: float
    status: str
    tid: int | None = None


@dataclass(slots=True)
class ErrorSpan:
    """A span that ended with an exception."""

    name: str
    span_id: str
    parent_span_id: str | None
    step: int | None
    ts: float
    error_type: str
    message: str


_PLAIN_END = (schema.STATUS_OK, None)
_NONE = -1


class CommLog:
    """Every ``comm.*`` op a process closed (or shutdown ended), in columns: about 70 bytes an op.

    Strings (group, op, dtype, state, clock, phase) are numbered in ``strings``; span ids are kept
    as integers. :meth:`op` makes the :class:`~otel_train.analysis.comm.CommOp` of row ``i``.
    """

    __slots__ = ("strings", "_index", "_sixes", "start", "end", "seq", "peer", "nbytes", "step", "tid", "sid",
                 "codes", "odd_sids")

    def __init__(self) -> None:
        self.strings: list[str | None] = [None]
        self._index: dict[str | None, int] = {None: 0}
        self._sixes: dict[tuple[str | None, ...], tuple[int, ...]] = {}  # (group, op, ...) -> their codes: few repeat
        self.start, self.end = array("d"), array("d")
        self.seq, self.peer, self.nbytes, self.step, self.tid = (array("q") for _ in range(5))
        self.sid = array("Q")
        self.codes = array("I")  # 6 per op: group, op, dtype, state, clock, phase
        self.odd_sids: dict[int, str] = {}  # span ids that are not 16 hex digits

    def __len__(self) -> int:
        return len(self.seq)

    def _code(self, value: str | None) -> int:
        code = self._index.get(value)
        if code is None:
            code = self._index[value] = len(self.strings)
            self.strings.append(value)
        return code

    def append(self, fields: tuple[Any, ...], start: float, end: float | None, step: int | None,
               sid: str | None, tid: int | None, state: str, phase: str | None) -> None:
        """One op: ``fields`` as :func:`comm_fields` gives them."""
        op, group, seq, peer, nbytes, dtype, clock = fields
        row = len(self.seq)
        self.start.append(start)
        self.end.append(float("nan") if end is None else end)
        self.seq.append(_NONE if seq is None else seq)
        self.peer.append(_NONE if peer is None else peer)
        self.nbytes.append(_NONE if nbytes is None else nbytes)
        self.step.append(_NONE if step is None else step)
        self.tid.append(_NONE if tid is None else tid)
        try:
            self.sid.append(int(sid, 16) if sid and len(sid) <= 16 else 0)
        except ValueError:
            self.sid.append(0)
        if sid and not self.sid[row]:
            self.odd_sids[row] = sid
        six = (group, op, dtype, state, clock, phase)
        codes = self._sixes.get(six)
        if codes is None:
            codes = self._sixes[six] = tuple(map(self._code, six))
        self.codes.extend(codes)

    def op(self, i: int, rank: int, attempt: int) -> CommOp:
        """Row ``i`` as a CommOp."""
        s, c = self.strings, 6 * i
        codes = self.codes
        end, sid, peer, nbytes, step, tid = self.end[i], self.sid[i], self.peer[i], self.nbytes[i], self.step[i], self.tid[i]
        return CommOp(rank, attempt, s[codes[c]] or "", self.seq[i], s[codes[c + 1]] or "", self.start[i],
                      None if end != end else end, None if peer == _NONE else peer,
                      None if nbytes == _NONE else nbytes, s[codes[c + 2]], None if step == _NONE else step,
                      self.odd_sids.get(i) or (f"{sid:016x}" if sid else None), None if tid == _NONE else tid,
                      s[codes[c + 3]] or "ok", SOURCE_TRACE, s[codes[c + 4]] or schema.COMM_CLOCK_HOST,
                      s[codes[c + 5]])


def _int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def comm_fields(name: str, attrs: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """(op, group, seq, peer, bytes, dtype, clock) of a ``comm.*`` span's attributes; None without a
    group and a seq (an op that cannot be matched)."""
    op = schema.comm_op_of(name)
    if op is None or not attrs:
        return None
    group, seq = attrs.get(schema.ATTR_COMM_GROUP), _int(attrs.get(schema.ATTR_COMM_SEQ))
    if type(group) is int:
        group = str(group)
    if type(group) is not str or seq is None:
        return None
    dtype, clock = attrs.get(schema.ATTR_COMM_DTYPE), attrs.get(schema.ATTR_COMM_CLOCK)
    return (op, group, seq, _int(attrs.get(schema.ATTR_COMM_PEER)), _int(attrs.get(schema.ATTR_COMM_BYTES)),
            dtype if type(dtype) is str else None, clock if type(clock) is str else None)


def _group_of(attrs: dict[str, Any] | None) -> Group | None:
    attrs = attrs or {}
    group, desc, ranks = attrs.get("group"), attrs.get("desc"), attrs.get("ranks")
    if type(group) is int:
        group = str(group)
    if type(group) is not str or not isinstance(ranks, list) or not all(_int(r) is not None for r in ranks):
        return None
    return Group(group, desc if type(desc) is str else "", tuple(ranks))


def _mesh_of(attrs: dict[str, Any] | None) -> dict[str, tuple[int, int]]:
    attrs = attrs or {}
    dims, coords = attrs.get("dims"), attrs.get("coords")
    if not isinstance(dims, dict) or not isinstance(coords, dict):
        return {}
    return {str(k): (v, coords[k]) for k, v in dims.items()
            if _int(v) is not None and _int(coords.get(k)) is not None}
def _anchor_of(clock: Any) -> int | None:
    """A process_start's ``clock`` ({wall_ns, mono_ns}) as wall minus monotonic ns; None when absent or odd."""
    if not isinstance(clock, dict):
        return None
    wall, mono = clock.get("wall_ns"), clock.get("mono_ns")
    return wall - mono if type(wall) is int and type(mono) is int else None


_ts = attrgetter("ts")
_start_ts = attrgetter("start_ts")


class ProcessState:
    """What one process attempt wrote so far, fed record batches in file order (see the module doc)."""

    __slots__ = (
        "source", "rank", "attempt", "instance", "keep",
        "host", "pid", "world_size", "local_rank", "run_id", "job_id", "format",
        "first_ts", "last_ts", "last_event", "first_step", "final_step", "relative_step",
        "records", "malformed", "ended_cleanly", "end_signal", "last_closed", "last_heartbeat_ts", "settings",
        "phases", "parents", "errors", "incomplete", "stalls", "opened",
        "spans", "instants", "scalars", "_sinks",
        "comm", "comm_groups", "mesh", "_comm_sinks", "_comm_phase",
        "epochs", "_epoch", "_shift", "_top", "_offsets", "clock_anchor", "clock_steps",
    )

    def __init__(self, source: str, rank: int, attempt: int, instance: str = "", *, keep: bool = False) -> None:
        self.source, self.rank, self.attempt, self.instance, self.keep = source, rank, attempt, instance, keep
        self.host: str | None = None
        self.pid: int | None = None
        self.world_size: int | None = None
        self.local_rank: int | None = None
        self.run_id: str | None = None
        self.job_id: str | None = None; self.format = types.FORMAT_OURS  # noqa: E702 (whose files: Head.format)
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.last_event: str | None = None
        self.first_step: int | None = None
        self.final_step: int | None = None
        self.relative_step: int | None = None
        self.records = 0
        self.malformed = 0
        self.ended_cleanly = False
        self.end_signal: str | None = None  # process_end's signal: shut down on a SIGTERM (not died)
        self.last_closed: str | None = None  # last phase that closed inside the current step
        self.last_heartbeat_ts: float | None = None
        self.settings: dict[str, Any] = {}  # the process's resolved settings (its process_start record)
        self.phases: dict[str, PhaseSeries] = {}
        self.parents: dict[str, str | None] = {}
        self.errors: list[ErrorSpan] = []
        self.incomplete: list[OpenSpan] = []  # ended by shutdown
        self.stalls: dict[str, Instant] = {}  # the latest stall record per stalled span id
        self.opened: dict[str | None, SpanStart] = {}  # start records without an end yet, in start order
        self.spans: list[Span] = []  # keep=True: closed spans, in end order
        self.instants: list[Instant] = []  # keep=True
        self.scalars: list[Scalar] = []  # keep=True
        self._sinks: dict[str, tuple[Callable[[Any], None], ...]] = {}
        self.comm = CommLog()  # every comm.* op closed or ended by shutdown; open ones stay in ``opened``
        self.comm_groups: dict[str, Group] = {}  # comm.group instants
        self.mesh: dict[str, tuple[int, int]] = {}  # otel_train.mesh: dim -> (size, index)
        self._comm_sinks: dict[str, tuple[Callable[[Any], None], ...]] = {}  # comm.* names: not in _sinks
        self._comm_phase: str | None = None  # the last phase before the latest comm op
        # Step numbering across epochs (docs/analysis.md, "The span model"): each epoch's offset, the
        # current epoch and its offset, the highest (global) step seen; ``epochs``: (first global step,
        # epoch, offset) of every epoch in the order seen.
        self.epochs: list[tuple[int, int, int]] = []
        self._epoch: int | None = None
        self._shift = 0
        self._top = -1
        self._offsets: dict[int, int] = {}
        # The records' clock (docs/clock.md, "Clock steps"): its anchor's wall minus monotonic time (ns),
        # from process_start; and the wall-clock steps the watchdog saw (clock_step: ts, step_s).
        self.clock_anchor: int | None = None
        self.clock_steps: list[tuple[float, float]] = []

    @classmethod
    def of(cls, pf: ProcessFiles, attempt: int, *, keep: bool = False, meta: Head | None = None) -> ProcessState:
        """A state for the process ``pf`` with its identity taken from ``meta`` (or the file's head)."""
        state = cls(pf.source, pf.rank, attempt, pf.instance, keep=keep)
        state.identify(meta if meta is not None else head(pf))
        return state

    def identify(self, meta: Head | None) -> None:
        """Take host, pid, world size, local rank, run and job id from a file head."""
        if meta is not None:
            self.host, self.pid, self.world_size = meta.host, meta.pid, meta.world_size
            self.local_rank, self.run_id, self.job_id, self.format = meta.local_rank, meta.run_id, meta.job_id, meta.format

    # -- feeding --------------------------------------------------------------------------------

    def feed(self, items: list[AnyRecord]) -> None:
        """Pair a batch of records (in file order) into the state."""
        if not items:
            return
        opened, keep = self.opened, self.keep
        pop = opened.pop
        sinks, parents = self._sinks, self.parents
        spans_append = self.spans.append
        last_closed = self.last_closed
        if self.first_ts is None:
            self.first_ts = items[0].ts
        epoch, shift = self._epoch, self._shift
        # The hot loop: locals only, a span closing with status ok inline, everything else in methods.
        for rec in items:
            if rec.epoch != epoch:  # a new epoch (or a late record of an old one): its step numbering
                self._renumber(rec, items)
                epoch, shift = self._epoch, self._shift
            elif shift and rec.step is not None:
                rec.step += shift
            cls = type(rec)
            if cls is SpanEnd:
                started = pop(rec.span_id, None)
                dur = rec.dur_ms
                if started is None or dur is None or rec.status not in _PLAIN_END:
                    self.last_closed = last_closed
                    self._end_rare(rec, started)  # type: ignore[arg-type]
                    last_closed = self.last_closed
                    continue
                name = rec.name
                sink = sinks.get(name) or self._sink(name, rec, started, last_closed)  # comm.*: every time
                sstep = started.step
                sink[0](NO_STEP if sstep is None else sstep)
                sink[1](dur)
                sink[2](rec.ts)
                if name != STEP:
                    last_closed = name
                if keep:
                    attrs = started.attrs
                    if rec.attrs:
                        attrs = {**attrs, **rec.attrs} if attrs else rec.attrs
                    spans_append(Span(name, rec.span_id, started.parent_span_id, started.trace_id, started.ts,
                                      rec.ts, schema.STATUS_OK, started.tid, sstep, attrs, None, started))
            elif cls is SpanStart:
                name = rec.name
                opened[rec.span_id] = rec  # type: ignore[assignment]
                if name not in parents:
                    parent = opened.get(rec.parent_span_id)
                    parents[name] = parent.name if parent is not None else None
                if name == STEP:
                    last_closed = None
            elif cls is Instant:
                self._instant(rec)  # type: ignore[arg-type]
            elif keep:
                self.scalars.append(rec)  # type: ignore[arg-type]
        self.last_closed = last_closed
        self._tally(items)
        self._track_steps(items)

    def _tally(self, items: list[AnyRecord]) -> None:
        """After a batch: the record count, the last event and the latest time."""
        self.records += len(items)
        self.last_event = items[-1].event
        top = max(map(_ts, items))
        if self.last_ts is None or top > self.last_ts:
            self.last_ts = top

    def _renumber(self, rec: AnyRecord, batch: list[AnyRecord]) -> None:
        """A record whose epoch is not the current one: number its step (docs/analysis.md, "The span model").

        The first step of a new epoch that does not go past the highest step seen so far means steps
        repeat every epoch: that epoch's steps are shifted past it (its offset is the highest global
        step + 1); otherwise they stay as written. A late record of an older epoch (the comm
        recorder's thread) takes that epoch's offset; a record without an epoch or a step is left."""
        epoch, step = rec.epoch, rec.step
        if epoch is None or step is None:
            return
        offset = self._offsets.get(epoch)
        if offset is None:  # a new epoch: the highest step so far includes this batch's earlier records
            for earlier in batch:
                if earlier is rec:
                    break
                if earlier.step is not None and earlier.step > self._top:
                    self._top = earlier.step
            offset = self._offsets[epoch] = self._top + 1 if step <= self._top else 0
            self.epochs.append((step + offset, epoch, offset))
            self._epoch, self._shift = epoch, offset
        rec.step = step = step + offset
        if step > self._top:
            self._top = step

    def _track_steps(self, items: list[AnyRecord]) -> None:
        # The step context, taken from each batch's first and last records rather than per record.
        if self.first_step is None:
            self.first_step = next((r.step for r in items if r.step is not None), None)
        # comm.* records may be written after later steps' records (the recorder's thread writes them
        # off the training thread, with their own step): they never move the step back.
        for r in reversed(items):
            if r.step is not None and not r.name.startswith(schema.COMM_PREFIX):
                self.final_step = r.step
                if r.relative_step is not None:  # the step is numbered across epochs: so is this
                    self.relative_step = r.relative_step + (self._offsets.get(r.epoch, 0) if r.epoch is not None else 0)
                break
        if self.final_step is not None and self.final_step > self._top:
            self._top = self.final_step

    def _sink(self, name: str, rec: SpanEnd | None = None, started: SpanStart | None = None,
              last_closed: str | None = None) -> tuple[Callable[[Any], None], ...]:
        """The appenders of a name's duration columns, cached in ``_sinks`` on first sight; a ``comm.*``
        name is never cached there, so each of its plain ends (``rec``) comes here to be kept as an op."""
        comm = self._comm_sinks.get(name)
        if comm is None and schema.comm_op_of(name) is not None:
            comm = self._comm_sinks[name] = self._series(name)
        if comm is None:
            sink = self._sinks[name] = self._series(name)
            return sink
        if rec is not None and started is not None:
            self._comm_end(name, started, rec.ts, schema.STATUS_OK, last_closed, rec.attrs)
        return comm

    def _comm_end(self, name: str, started: SpanStart | SpanEnd, end: float | None, state: str,
                  last_closed: str | None, end_attrs: dict[str, Any] | None = None) -> None:
        """Keep one closed (or incomplete: ``end`` None) comm op."""
        attrs = started.attrs
        if end_attrs:
            attrs = {**attrs, **end_attrs} if attrs else end_attrs
        fields = comm_fields(name, attrs)
        if fields is None:
            return
        if last_closed is not None and not last_closed.startswith(schema.COMM_PREFIX):
            self._comm_phase = last_closed
        start = started.began() if type(started) is SpanEnd else started.ts
        self.comm.append(fields, start, end, started.step, started.span_id, started.tid, state, self._comm_phase)

    def _series(self, name: str) -> tuple[Callable[[Any], None], ...]:
        series = self.phases.get(name)
        if series is None:
            series = self.phases[name] = PhaseSeries()
        return (series.steps.append, series.durs.append, series.ends.append)

    def _caller_went_on(self, name: str, started: SpanStart | None) -> bool:
        """Whether a ``comm.*`` op never seen to end (ended ``incomplete`` by shutdown, or still open) has
        a parent span that has already ended: the rank did not stop inside it (its caller returned or
        raised, so the op was done or abandoned), the recorder only never saw it finish (a Flight
        Recorder entry whose completion gloo had not marked yet, at exit or at a SIGKILL)."""
        if started is None or not name.startswith(schema.COMM_PREFIX):
            return False
        parent = started.parent_span_id
        return parent is not None and parent not in self.opened and all(u.span_id != parent for u in self.incomplete)

    def _end_rare(self, rec: SpanEnd, started: SpanStart | None) -> None:
        """A span end that is not a plain ok: error, incomplete, or without its start or duration."""
        name = rec.name
        sid = rec.span_id or ""
        step = started.step if started is not None else rec.step
        status = rec.status or schema.STATUS_OK
        if status == schema.STATUS_INCOMPLETE and self._caller_went_on(name, started):
            status = schema.STATUS_OK
        if started is not None:
            start_ts = started.ts
        else:  # its start record rotated away: it began dur_ms before its end
            start_ts = rec.began()
        parent = started.parent_span_id if started is not None else rec.parent_span_id
        tid = started.tid if started is not None else rec.tid
        if self.keep:
            attrs = started.attrs if started is not None else None
            if rec.attrs:
                attrs = {**attrs, **rec.attrs} if attrs else rec.attrs
            trace_id = started.trace_id if started is not None else rec.trace_id
            self.spans.append(Span(name, sid, parent, trace_id, start_ts, rec.ts, status, tid, step, attrs,
                                   rec.error, started if started is not None else rec))
        if name.startswith(schema.COMM_PREFIX):
            self._comm_end(name, started if started is not None else rec,
                           None if status == schema.STATUS_INCOMPLETE else rec.ts, status, self.last_closed,
                           rec.attrs if started is not None else None)
        if status == schema.STATUS_INCOMPLETE:
            self.incomplete.append(OpenSpan(name, sid, parent, step, start_ts, status, tid))
            return
        dur = rec.dur_ms if rec.dur_ms is not None else (rec.ts - start_ts) * 1000.0
        self.parents.setdefault(name, None)
        sink = self._sinks.get(name) or self._sink(name)
        sink[0](NO_STEP if step is None else step)
        sink[1](dur)
        sink[2](rec.ts)
        if status == schema.STATUS_ERROR:
            err = rec.error or {}
            self.errors.append(ErrorSpan(name, sid, parent, step, rec.ts, str(err.get("type", "error")),
                                         str(err.get("message", ""))))
        if name != STEP:
            self.last_closed = name

    def _instant(self, rec: Instant) -> None:
        name = rec.name
        if name == schema.INSTANT_PROCESS_END:
            self.ended_cleanly = True
            signal = (rec.attrs or {}).get("signal")
            self.end_signal = signal if isinstance(signal, str) else None
        elif name == schema.INSTANT_PROCESS_START:
            settings = (rec.attrs or {}).get("settings")
            self.settings = settings if isinstance(settings, dict) else {}
            self.clock_anchor = _anchor_of((rec.attrs or {}).get("clock"))
        elif name == schema.INSTANT_CLOCK_STEP:
            step = (rec.attrs or {}).get("step_s")
            if type(step) in (int, float):
                self.clock_steps.append((rec.ts, float(step)))
        elif name == schema.INSTANT_HEARTBEAT:
            self.last_heartbeat_ts = rec.ts
        elif name == schema.INSTANT_STALL:
            self.stalls[rec.span_id or ""] = rec
        elif name == schema.INSTANT_COMM_GROUP:
            group = _group_of(rec.attrs)
            if group is not None:
                self.comm_groups[group.group] = group
        elif name == schema.INSTANT_MESH:
            self.mesh = _mesh_of(rec.attrs) or self.mesh
        if self.keep:
            self.instants.append(rec)

    # -- reading the state ----------------------------------------------------------------------

    @property
    def renumbered(self) -> bool:
        """Whether this process's steps repeated across epochs and were numbered globally."""
        return any(offset for _, _, offset in self.epochs)

    def epoch_step(self, step: int | None) -> tuple[int, int] | None:
        """(epoch, step as the process wrote it) of a global step, when steps were renumbered; else None."""
        if step is None or step < 0 or not self.renumbered:
            return None
        best = None
        for first, epoch, offset in self.epochs:
            if first <= step and (best is None or first >= best[0]):
                best = (first, epoch, offset)
        return None if best is None else (best[1], step - best[2])

    def step_text(self, step: int | None) -> str:
        """A step as messages print it: ``17``, or ``17 (epoch 1, step 2)`` when steps were renumbered."""
        original = self.epoch_step(step)
        return str(step) if original is None else f"{step} (epoch {original[0]}, step {original[1]})"

    @property
    def unclosed(self) -> list[OpenSpan]:
        """Spans running at the end (open) or ended by shutdown (incomplete), outermost first."""
        out = self.incomplete + [
            OpenSpan(r.name, r.span_id or "", r.parent_span_id, r.step, r.ts, STATUS_OPEN, r.tid)
            for r in self.opened.values() if not self._caller_went_on(r.name, r)
        ]
        out.sort(key=_start_ts)
        return out

    @property
    def innermost(self) -> OpenSpan | None:
        """The deepest span still running at the end, if any."""
        unclosed = self.unclosed
        return unclosed[-1] if unclosed else None

    def last_phase(self) -> str | None:
        """The innermost running phase, or the last phase that closed when only ``step`` is open."""
        inner = self.innermost
        if inner is None:
            return None
        return self.last_closed if inner.name == STEP and self.last_closed else inner.name

    def layout(self, records: Iterable[AnyRecord]) -> None:
        """Take only the ``comm.group`` and ``otel_train.mesh`` instants of ``records`` (a file's head,
        which ``summarize --fast`` reads besides the tail: groups are declared before their first op)."""
        for rec in records:
            if type(rec) is Instant and rec.name in (schema.INSTANT_COMM_GROUP, schema.INSTANT_MESH):
                keep, self.keep = self.keep, False
                self._instant(rec)
                self.keep = keep

    def comm_ops(self, since: int = 0) -> tuple[list[CommOp], int]:
        """The comm ops closed (or ended by shutdown) from row ``since`` on, then every op still open
        (a rank waiting in it); and the row to pass as ``since`` next time."""
        log = self.comm
        done = len(log)
        ops = [log.op(i, self.rank, self.attempt) for i in range(since, done)]
        for r in self.opened.values():
            fields = comm_fields(r.name, r.attrs) if r.name.startswith(schema.COMM_PREFIX) else None
            if fields is not None:
                op, group, seq, peer, nbytes, dtype, clock = fields
                ops.append(CommOp(self.rank, self.attempt, group, seq, op, r.ts, None, peer, nbytes, dtype, r.step,
                                  r.span_id, r.tid, STATUS_OPEN, clock=clock or schema.COMM_CLOCK_HOST,
                                  phase=self._open_phase()))
        return ops, done

    def _open_phase(self) -> str | None:
        last = self.last_closed
        return last if last is not None and not last.startswith(schema.COMM_PREFIX) else self._comm_phase

    def drain(self) -> tuple[list[Span], list[Instant], list[Scalar]]:
        """(``keep=True``) Take the spans closed, instants and scalars fed since the last drain: a tail
        (``push --follow``) ships them as they come; open spans stay in the state."""
        out = (self.spans, self.instants, self.scalars)
        self.spans, self.instants, self.scalars = [], [], []
        return out

    def finish(self) -> None:
        """After the last batch (``keep=True``): open spans join ``spans``, all in start order."""
        if self.format != types.FORMAT_OURS and not self.opened:  # their files have no end record
            self.ended_cleanly = True
        if self.keep:
            for r in self.opened.values():
                self.spans.append(Span(r.name, r.span_id or "", r.parent_span_id, r.trace_id, r.ts, None,
                                       STATUS_OPEN, r.tid, r.step, r.attrs, None, r))
            self.spans.sort(key=_start_ts)


# ---------------------------------------------------------------------------------------------
# Attempts, the step window


def assign_attempts(pfs: Iterable[ProcessFiles], heads: dict[ProcessFiles, Head | None] | None = None
                    ) -> dict[ProcessFiles, int]:
    """Map each process to its restart attempt.

    The ``attempt`` field of a process's first readable records wins. When it is missing, or two
    instances of the same (source, rank) claim the same attempt (restarts the launcher did not
    number), instances are numbered by start time (the file name's stamp) instead.
    """
    heads = heads if heads is not None else {}
    by_key: dict[tuple[str, int], list[tuple[int | None, ProcessFiles]]] = {}
    for pf in pfs:
        meta = heads[pf] if pf in heads else heads.setdefault(pf, head(pf))
        by_key.setdefault((pf.source, pf.rank), []).append((meta.attempt if meta else None, pf))
    out: dict[ProcessFiles, int] = {}
    for items in by_key.values():
        items.sort(key=lambda it: it[1].instance)
        claimed = [a for a, _ in items]
        if None in claimed or len(set(claimed)) != len(claimed):
            out.update({pf: i for i, (_, pf) in enumerate(items)})
        else:
            out.update({pf: a for a, pf in items})  # type: ignore[misc]
    return out


def keep_steps(state: ProcessState, lo: int, hi: int) -> None:
    """Keep (``keep=True`` state) the spans, instants and scalars of steps ``lo..hi`` (inclusive), and
    those without a step that overlap the in-range ones in time (an enclosing epoch span, say). The
    comparisons are written inline: a window of 1,024 processes makes half a million of them."""
    inside = [s for s in state.spans if s.step is not None and lo <= s.step <= hi]
    records = [r for r in (*state.instants, *state.scalars) if r.step is not None and lo <= r.step <= hi]
    times = [s.start_ts for s in inside] + [s.end_ts for s in inside if s.end_ts is not None] + [r.ts for r in records]
    if not times:
        state.spans, state.instants, state.scalars = [], [], []
        return
    t0, t1 = min(times), max(times)
    last = state.last_ts or t1
    state.spans = [s for s in state.spans if (lo <= s.step <= hi if s.step is not None else
                                              s.start_ts <= t1 and (s.end_ts if s.end_ts is not None else last) >= t0)]
    state.instants = [r for r in state.instants if (lo <= r.step <= hi if r.step is not None else t0 <= r.ts <= t1)]
    state.scalars = [r for r in state.scalars if (lo <= r.step <= hi if r.step is not None else t0 <= r.ts <= t1)]


# ---------------------------------------------------------------------------------------------
# Whole runs


def read_process(pf: ProcessFiles, attempt: int, reader: Reader, *, keep: bool = False,
                 steps: tuple[int, int] | None = None, meta: Head | None = None,
                 plan: window.Plan | None = None) -> ProcessState:
    """One process's files fed into a new state (finished; step window applied).

    With ``steps`` only the window's bytes and what its spans need are read (:mod:`.reading.window`),
    unless the process's steps are not monotone: then every record, as without a window. Either
    way the state is then cut to the window (:func:`restrict`). ``plan``: the window's plan when the
    caller made it already."""
    state = ProcessState.of(pf, attempt, keep=keep, meta=meta)
    before = reader.malformed_lines
    if plan is None and steps is not None:
        plan = window.plan(pf, *steps)
    with _cycles_unchecked():
        if plan is not None:
            _feed_window(state, pf, plan, reader, steps[0])  # type: ignore[index]
        else:
            for batch in reader.batches(pf):
                state.feed(batch)
    state.malformed = reader.malformed_lines - before
    state.finish()
    if steps is not None:
        restrict(state, *steps)
        if keep:
            keep_steps(state, *steps)
    return state


def _feed_window(state: ProcessState, pf: ProcessFiles, plan: window.Plan, reader: Reader, lo: int) -> None:
    """Feed the plan's ranges in file order; before the tail, the ends of head spans still open. After
    bytes not read, a span start of a step before ``lo`` is left out (its parent may be unread), and
    an end whose start was not read (and that began after the oldest record: no orphan) with it; its
    step is before the window (docs/analysis.md, "Reading")."""
    seen: set[str | None] = set()
    first_ts = plan.first_ts if plan.first_ts is not None else 0.0
    for k, rng in enumerate(plan.ranges):
        if k == len(plan.ranges) - 1:
            stepless = [r.span_id for r in state.opened.values() if r.step is None and r.span_id]
            if stepless:
                state.feed(window.find_ends(pf, plan, stepless))
        batch = window.read_range(rng, reader.bad)
        if reader._progress is not None:
            reader._progress(rng.end - rng.start)
        if rng.gap:  # a span started before the window: its start, and so its end, are left out
            batch = [r for r in batch if type(r) is not SpanStart or r.step is None or r.step >= lo]
        seen.update(r.span_id for r in batch if type(r) is SpanStart)
        if rng.gap:
            batch = [r for r in batch if type(r) is not SpanEnd or r.span_id in seen
                     or r.began() < first_ts - 5e-4]
        state.feed(batch)


def restrict(state: ProcessState, lo: int, hi: int) -> None:
    """Cut a finished state to steps ``lo..hi`` (inclusive): phase columns, errors, open and incomplete
    spans, stalls and comm ops of other steps (or of none) are dropped; what the process is (identity,
    how it ended, its last step and event, comm groups) stays whole. A full read and a window read of
    the same process cut to the same window are equal (tests/test_windows.py)."""

    def within(step: int | None) -> bool:
        return step is not None and lo <= step <= hi

    for name, series in list(state.phases.items()):
        rows = [i for i, s in enumerate(series.steps) if lo <= s <= hi]
        if not rows:
            del state.phases[name]
            continue
        if len(rows) < len(series.steps):
            state.phases[name] = PhaseSeries(array("q", [series.steps[i] for i in rows]),
                                             array("d", [series.durs[i] for i in rows]),
                                             array("d", [series.ends[i] for i in rows]))
    state.errors = [e for e in state.errors if within(e.step)]
    state.incomplete = [u for u in state.incomplete if within(u.step)]
    state.opened = {k: r for k, r in state.opened.items() if within(r.step)}
    state.stalls = {k: r for k, r in state.stalls.items() if within(r.step)}
    names = set(state.phases) | {u.name for u in state.unclosed}
    state.parents = {k: v for k, v in state.parents.items() if k in names}
    log, kept = state.comm, CommLog()
    kept.strings, kept._index, kept._sixes, kept.odd_sids = log.strings, log._index, log._sixes, {}
    for i in range(len(log)):
        if lo <= log.step[i] <= hi:
            for column in ("start", "end", "seq", "peer", "nbytes", "step", "tid", "sid"):
                getattr(kept, column).append(getattr(log, column)[i])
            kept.codes.extend(log.codes[6 * i:6 * i + 6])
            if i in log.odd_sids:
                kept.odd_sids[len(kept) - 1] = log.odd_sids[i]
    state.comm = kept


@contextmanager
def _cycles_unchecked() -> Iterator[None]:
    # Reading a process makes a dict or two per record, none in a reference cycle; with keep=True
    # they all live on, and the cycle collector's passes over them cost a third of the read.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_chosen_run: contextvars.ContextVar[str | None] = contextvars.ContextVar("otel_train_run_id", default=None)


def use_run(run_id: str | None) -> None:
    """``--run-id``: the run every following read in this context analyses (None: the default rule)."""
    _chosen_run.set(run_id)


def run_started(heads: Iterable[Head | None]) -> float:
    """When a run started: its processes' earliest first record."""
    return min((h.ts for h in heads if h is not None), default=0.0)


GENERATED_RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{8}")
"""The run id a process makes up when no launcher gave one (otel_train.resource: the UTC time and 8 hex
digits): each rank of such a job has its own, so it tells runs apart only when its processes make a
whole world (a single-process run, say)."""


def run_keys(heads: dict[ProcessFiles, Head | None]) -> dict[str | None, str | None]:
    """Each run id of the heads to the run it stands for: itself, or None ("no shared run id") for a
    made-up id whose processes are fewer than their world size (the ranks of one job, each with its own)."""
    ranks: dict[str | None, set[int]] = {}
    world: dict[str | None, int] = {}
    for pf, meta in heads.items():
        if meta is not None:
            ranks.setdefault(meta.run_id, set()).add(pf.rank)
            world[meta.run_id] = max(world.get(meta.run_id, 1), meta.world_size or 1)
    return {rid: rid if rid is None or not GENERATED_RUN_ID.fullmatch(rid) or len(ranks[rid]) >= world[rid]
            else None for rid in ranks}


def choose_run(heads: dict[ProcessFiles, Head | None], path: str | Path, wanted: str | None = None
               ) -> tuple[str | None, str | None, frozenset[str | None]]:
    """Which run of a directory to analyse (docs/analysis.md, "Several runs in one directory"): its name,
    the line that says so when the directory holds several (else None), and the run ids its processes
    carry. ``wanted`` (``--run-id``, default: the one set by :func:`use_run`), or the run started last.
    Raises TraceReadError for a ``wanted`` id it does not hold."""
    wanted = wanted if wanted is not None else _chosen_run.get()
    keys = run_keys(heads)
    runs: dict[str | None, list[Head | None]] = {}
    for meta in heads.values():
        if meta is not None:  # a file without a whole record yet goes with the chosen run
            runs.setdefault(keys[meta.run_id], []).append(meta)
    names = sorted(runs, key=lambda r: (run_started(runs[r]), str(r)))
    if wanted is not None and wanted not in runs:
        held = ", ".join(str(r) for r in names) or "none"
        raise TraceReadError(f"{path}: no run with id {wanted!r} here (runs: {held}); pass one of them to --run-id")
    chosen = wanted if wanted is not None else (names[-1] if names else None)
    members = frozenset(rid for rid, key in keys.items() if key == chosen)
    if len(runs) < 2:
        return chosen, None, members
    name = chosen if chosen is not None else "without a shared run id"
    return chosen, f"run {name} ({len(runs)} runs in {path}; --run-id to pick another)", members


def in_run(meta: Head | None, members: frozenset[str | None], note: str | None) -> bool:
    """Whether a process (its head) belongs to the chosen run (``members``: its run ids); every one does
    when there is one run."""
    return note is None or meta is None or meta.run_id in members


def process_order(path: str | Path, ranks: set[int] | None = None, warn: Warn = warn_to_stderr
                  ) -> list[tuple[ProcessFiles, int, Head | None]]:
    """The run's processes (of ``ranks``, when given) with attempt and head, sorted by rank, attempt, source.

    A directory holding several runs (run ids) gives the processes of one (:func:`choose_run`) and says
    which through ``warn``. Raises TraceReadError when ``path`` holds no trace files (or not the run asked for).
    """
    found = find_process_files(path, warn)
    heads: dict[ProcessFiles, Head | None] = {pf: head(pf) for pf in found}
    _, note, members = choose_run(heads, path)
    if note is not None:
        warn(note)
    pfs = [pf for pf in found if (ranks is None or pf.rank in ranks) and in_run(heads[pf], members, note)]
    attempts = assign_attempts(pfs, heads)
    pfs.sort(key=lambda pf: (pf.rank, attempts[pf], pf.source))
    return [(pf, attempts[pf], heads[pf]) for pf in pfs]


def iter_processes(
    path: str | Path,
    reader: Reader,
    *,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
) -> Iterator[ProcessState]:
    """Each process's full state (``keep=True``: spans, instants, scalars), one in memory at a time,
    sorted by rank then attempt; processes without a valid record are left out."""
    for pf, attempt, meta in process_order(path, ranks, reader.bad.warn):
        state = read_process(pf, attempt, reader, keep=True, steps=steps, meta=meta)
        if state.records:
            yield state


@dataclass(slots=True)
class Run:
    """The processes of a run (``keep=False`` states), sorted by (rank, attempt, source).

    ``extra_ops``/``extra_groups``: comm ops and groups read from Flight Recorder dumps, merged into
    the comm graphs (:attr:`comm`).
    """

    processes: list[ProcessState]
    malformed_lines: int = 0
    extra_ops: list[CommOp] = field(default_factory=list)
    extra_groups: list[Group] = field(default_factory=list)
    graphs: dict[tuple[str, int], CommGraph] | None = field(default=None, repr=False, compare=False)
    align: bool = True  # compare hosts on the estimated reference clock (docs/clock.md); False: raw clocks

    @property
    def comm(self) -> dict[tuple[str, int], CommGraph]:
        """The communication graph of each (source, attempt) (docs/comm.md), built on first use."""
        if self.graphs is None:
            self.graphs = build_graphs(self, self.extra_ops, self.extra_groups)
        return self.graphs

    def phase_order(self) -> list[str]:
        """Phase names in training-step order: the standard phases first, then others as first seen."""
        order = [STEP, *STEP_PHASES]
        seen = set(order)
        for d in self.processes:  # as first seen (not a set's order: the same answer every time)
            for name in [*d.phases, *(u.name for u in d.unclosed)]:
                if name not in seen:
                    seen.add(name)
                    order.append(name)
        return order

    def groups(self) -> list[list[ProcessState]]:
        """Processes that ran together: one list per (source, attempt), ranks ascending."""
        by_key: dict[tuple[str, int], list[ProcessState]] = {}
        for d in self.processes:
            by_key.setdefault((d.source, d.attempt), []).append(d)
        return [sorted(by_key[k], key=lambda d: d.rank) for k in sorted(by_key)]


def _read_task(args: tuple[ProcessFiles, int, Head | None]) -> tuple[ProcessState, list[str]]:
    warnings: list[str] = []
    state = read_process(args[0], args[1], Reader(warn=warnings.append), meta=args[2])
    state._sinks = state._comm_sinks = {}  # bound appenders: made again on demand, not worth pickling
    return state, warnings


def _read_all(tasks: list[tuple[ProcessFiles, int, Head | None]], store: Cache, workers: int
              ) -> list[tuple[ProcessState, list[str]]]:
    """Each process's (state, warnings): from the cache (extended by what was appended since), else
    read (by ``workers`` processes when > 1) and kept in the cache."""
    before = [[identify(p) for p in pf.paths] if store.enabled else [] for pf, _, _ in tasks]
    out: list[tuple[ProcessState, list[str]] | None] = [None] * len(tasks)
    for i, (pf, attempt, meta) in enumerate(tasks):
        hit = store.lookup(pf)
        if hit is None or not isinstance(hit.payload, tuple) or not isinstance(hit.payload[0], ProcessState):
            continue
        state, warnings = hit.payload
        state.attempt = attempt
        if hit.resume is not None:
            more = Reader(warn=warnings.append)
            for batch in more.batches(pf, hit.resume):
                state.feed(batch)
            state.malformed += more.malformed_lines
            state._sinks = state._comm_sinks = {}
            store.store(pf, before[i], (state, warnings))
        out[i] = (state, warnings)
    todo = [i for i, got in enumerate(out) if got is None]
    if workers > 1 and len(todo) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=pool_context()) as pool:
            read = list(pool.map(_read_task, [tasks[i] for i in todo]))
    else:
        read = [_read_task(tasks[i]) for i in todo]
    for i, got in zip(todo, read):
        store.store(tasks[i][0], before[i], got)
        out[i] = got
    return out  # type: ignore[return-value]


def load_run(
    path: str | Path,
    *,
    warn: Warn | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
    steps: tuple[int, int] | None = None,
    cache: bool = True,
) -> Run:
    """Every process of the run at ``path`` as a compact state; raises TraceReadError without trace files.

    ``warn`` gets one line per file with malformed lines (default: stderr); ``progress`` gets byte
    counts as they are consumed. ``workers`` (default: CPU count) > 1 reads large runs in parallel.
    ``steps`` (inclusive): only that window, read at the window's cost (:func:`read_process`).
    ``cache``: serve and keep each process's state in the run's read cache (:mod:`.reading.cache`).
    """
    reader = Reader(warn=warn, progress=progress)
    tasks = process_order(path, warn=reader.bad.warn)
    sizes = [pf.size for pf, _, _ in tasks]
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    states: list[ProcessState] = []
    if steps is not None:
        states = [read_process(pf, attempt, reader, meta=meta, steps=steps) for pf, attempt, meta in tasks]
    else:
        store = Cache(logs_dir(path), enabled=cache)
        parallel = workers > 1 and sum(sizes) >= PARALLEL_MIN_BYTES
        for size, (state, warnings) in zip(sizes, _read_all(tasks, store, workers if parallel else 1)):
            reader.absorb(state.malformed, warnings, size)
            states.append(state)
    states = [s for s in states if s.records]
    states.sort(key=lambda s: (s.rank, s.attempt, s.source))
    clock_domains(states)
    return Run(states, reader.malformed_lines)


ANCHOR_TOLERANCE_NS = 100_000_000
"""Processes of one host whose clocks' anchors differ by more than this (a wall-clock step between their
starts; a slewing NTP moves 0.5 ms a second) are clocks of their own (:func:`clock_domains`)."""


def clock_domains(states: list[ProcessState]) -> None:
    """Split a host whose processes anchored their clocks on different wall times (one started after a
    step of the host's wall clock) into clocks of their own: the processes of the first anchor keep the
    host's name, those of the k-th later one become ``host#k``, which the clock estimate aligns like any
    other host (docs/clock.md, "Clock steps"). Processes without an anchor (traces from before it) stay."""
    by_host: dict[str | None, list[ProcessState]] = {}
    for d in states:
        if d.clock_anchor is not None:
            by_host.setdefault(d.host, []).append(d)
    for host, members in by_host.items():
        anchors: list[int] = []  # one per domain, in order of the processes' first records
        for d in sorted(members, key=lambda d: d.first_ts or 0.0):
            k = next((i for i, a in enumerate(anchors) if abs(d.clock_anchor - a) <= ANCHOR_TOLERANCE_NS), None)  # type: ignore[operator]
            if k is None:
                k = len(anchors)
                anchors.append(d.clock_anchor)  # type: ignore[arg-type]
            if k:
                d.host = f"{host}#{k}"
