"""The second decoder: torchtitan's structured-logger files (and pimm's copy of it), read as they are.

Their files are named like ours (``<source>.global_rank_<rank>.<stamp>-<rand>.jsonl``); a buffer is
theirs when its first 4 KiB have the key ``log_type_name`` and not the key ``kind`` (each of ours has it). Their
records become the same record types ours decode into (docs/integrations-frameworks.md, "The file
format mapping"), so the one span model pairs them:

* ``log_type`` ``event``, ``log_type_name`` ``<name>_start``: a span start. Its id comes from the
  record's ``seq_id`` (see :class:`Stream`); its parent is the span open on top of its task's stack
  (one file is one source, so the stacks are per (source, task_name));
* ``<name>_end``: the end of the latest open span of that name on its task's stack (their LIFO rule),
  with ``value`` as ``dur_ms``; an end whose start is not in what was read (a window, a tail) keeps
  its own ``seq_id`` and is a span that began ``value`` ms before it (the model's orphan rule);
* ``<name>_error``: the next ``<name>_end`` of that task has status ``error`` and the message;
* ``log_type`` ``instant``: ``metric_value`` is a scalar ``{event_name: value}``; anything else an
  instant named by ``log_type_name``;
* ``time_us`` is the time, ``step``, ``relative_step``, ``step_tags`` (as tags), ``tid`` are kept;
  ``caller`` and ``task_name`` go into the span's or instant's attrs.

The stacks live in a :class:`Stream` per file, held by the read's :class:`~.lines.BadLines` (the one
object every reader passes along a file's chunks, in file order).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any

import msgspec

from otel_train import schema
from otel_train.analysis.reading.types import (
    DECODE_ERRORS,
    FORMAT_OURS,
    MAX_DUR_MS,
    MAX_ID,
    MAX_STEP,
    MAX_TS,
    AnyRecord,
    Head,
    Instant,
    Scalar,
    SpanEnd,
    SpanStart,
)

__all__ = ["FORMAT_OURS", "FORMAT_PIMM", "FORMAT_TITAN", "Stream", "decode", "head", "is_titan"]

FORMAT_TITAN = "torchtitan"
FORMAT_PIMM = "pimm"

METRIC = "metric_value"
EVENT = "event"
_START, _END, _ERROR = "_start", "_end", "_error"
_S, _E, _X, _OTHER = 0, 1, 2, 3
_SEQ_LIMIT = 1 << 48
_MISSING: Any = object()
CALLER = "code.caller"
TASK = "task_name"

_Us = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TS * 1e6)]
_Step = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
_Relative = Annotated[int, msgspec.Meta(ge=-MAX_STEP, le=MAX_STEP)]
_Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
_Value = Annotated[float, msgspec.Meta(ge=-MAX_DUR_MS, le=MAX_DUR_MS)]


class TitanLine(msgspec.Struct, gc=False):
    """The fields of one of their records that the mapping uses; others are skipped by the decoder."""

    log_type_name: str
    time_us: _Us
    log_type: str = EVENT
    event_name: str | None = None
    value: _Value | None = None
    step: _Step | None = None
    relative_step: _Relative | None = None
    step_tags: list[str] | None = None
    tid: _Id | None = None
    seq_id: _Id | None = None
    caller: str | None = None
    task_name: str | None = None
    message: str | None = None


class _TitanHead(msgspec.Struct, gc=False):
    time_us: _Us
    host_name: str | None = None
    pid: _Id | None = None
    local_rank: _Step | None = None
    step: _Step | None = None
    logger_name: str | None = None


TITAN_DECODER = msgspec.json.Decoder(TitanLine)
_HEAD_DECODER = msgspec.json.Decoder(_TitanHead)


def is_titan(buf: bytes | memoryview) -> bool:
    """Whether a buffer of whole lines is theirs: its first 4 KiB name ``log_type_name`` and never the key
    ``kind`` (every record of ours has ``"kind":"`` (or ``"kind": "``, rewritten by ``json.dumps``); a
    value ``"kind"`` of theirs is followed by ``,`` or ``}``; a bad first line does not decide)."""
    first = bytes(buf[:4096])
    return b'"log_type_name"' in first and b'"kind":"' not in first and b'"kind": "' not in first


class Stream:
    """One file's pairing state: the open spans per task (name, id), the errors waiting for their end,
    and the ids: a span's is its ``seq_id`` + 1 mixed with the file's name (16 hex digits, unique in
    the file), its trace's is one per (file, step) (32 hex digits), as OTLP wants them."""

    __slots__ = ("stacks", "errors", "count", "salt", "name", "traces", "kinds", "attrs")

    def __init__(self, path: Path | None = None) -> None:
        self.stacks: dict[str | None, list[tuple[str, str]]] = {}
        self.errors: dict[tuple[str | None, str], dict[str, Any]] = {}
        self.count = _SEQ_LIMIT  # ids for records without a seq_id: above any seq_id a file reaches
        self.name = path.name if path is not None else ""
        # bit 62 set, 63 clear: salt ^ n (n < 2**48) is 16 hex digits as hex() writes it (format() is 3x slower)
        self.salt = int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:8], "big") >> 2 | (1 << 62)
        self.traces: dict[int | None, str] = {}
        self.kinds: dict[str, tuple[int, str]] = {}  # log_type_name -> (start/end/error/other, name)
        self.attrs: dict[str | None, dict[str, Any] | None] = {}  # one per caller (task-less starts)

    def convert(self, lines: list[TitanLine]) -> list[AnyRecord]:
        """Their records, in file order, as ours (the hot loop: a start and a plain end inline, built
        positionally; names, attrs and trace ids are looked up, not made, after their first time)."""
        out: list[AnyRecord] = []
        append = out.append
        stacks, kinds, attrs_of, errors = self.stacks, self.kinds, self.attrs, self.errors
        salt, ok, start, end = self.salt, schema.STATUS_OK, SpanStart, SpanEnd
        last_step: Any = self  # no step equals it: the first record looks its trace id up
        tr = ""
        for r in lines:
            kind = r.log_type_name
            parsed = kinds.get(kind) or self._kind(kind)
            code = parsed[0]
            if code > _E or r.log_type != EVENT:
                if code == _X and r.log_type == EVENT:
                    errors[(r.task_name, parsed[1])] = _error(kind, r.message)
                else:
                    append(self._instant(r, kind))
                continue
            task, step = r.task_name, r.step
            stack = stacks.get(task)
            if stack is None:
                stack = stacks[task] = []
            if step != last_step:
                last_step, tr = step, self._trace(step)
            if code == _S:
                seq = r.seq_id
                sid = hex(salt ^ (seq + 1))[2:] if seq is not None and seq < _SEQ_LIMIT else self._id(r)
                attrs = attrs_of.get(r.caller, _MISSING) if task is None else _MISSING
                if attrs is _MISSING:
                    attrs = self._attrs(r)
                append(start(1, r.time_us / 1e6, parsed[1], sid, stack[-1][1] if stack else None, tr, step,
                             r.relative_step, None, None, r.step_tags, r.tid, attrs))
                stack.append((parsed[1], sid))
            elif stack and stack[-1][0] == parsed[1] and not errors:
                append(end(1, r.time_us / 1e6, parsed[1], stack.pop()[1], None, tr, step, r.relative_step,
                           None, None, r.step_tags, r.tid, None, r.value, ok))
            else:
                append(self._end(r, parsed[1], stack))
        return out

    def _attrs(self, r: TitanLine) -> dict[str, Any] | None:
        """A start's attrs: one dict per caller (shared: nothing changes a record's attrs), and per task."""
        if r.task_name is not None:
            return {CALLER: r.caller, TASK: r.task_name}
        got = self.attrs[r.caller] = None if r.caller is None else {CALLER: r.caller}
        return got

    def _kind(self, kind: str) -> tuple[int, str]:
        for code, suffix in ((_S, _START), (_E, _END), (_X, _ERROR)):
            if kind.endswith(suffix) and len(kind) > len(suffix):
                got = self.kinds[kind] = (code, kind[:-len(suffix)])
                return got
        got = self.kinds[kind] = (_OTHER, kind)
        return got

    def _trace(self, step: int | None) -> str:
        got = self.traces.get(step)
        if got is None:
            digest = hashlib.sha256(f"{self.name}\x00{step}".encode()).digest()
            got = self.traces[step] = digest[:16].hex()
        return got

    def _id(self, r: TitanLine) -> str:
        if r.seq_id is not None and r.seq_id < _SEQ_LIMIT:
            return hex(self.salt ^ (r.seq_id + 1))[2:]
        self.count += 1
        return hex(self.salt ^ self.count)[2:]

    def _end(self, r: TitanLine, name: str, stack: list[tuple[str, str]]) -> SpanEnd:
        sid = parent = None
        if stack and stack[-1][0] == name:
            sid = stack.pop()[1]
        else:  # not on top (a window began inside it, or a start was lost): the latest of that name
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == name:
                    sid = stack.pop(i)[1]
                    break
        if sid is None:  # its start was not read: an orphan end, placed by its duration
            sid = self._id(r)
            parent = stack[-1][1] if stack else None
        error = self.errors.pop((r.task_name, name), None) if self.errors else None
        return SpanEnd(v=1, ts=r.time_us / 1e6, name=name, span_id=sid, parent_span_id=parent,
                       trace_id=self._trace(r.step), step=r.step,
                       relative_step=r.relative_step, tags=r.step_tags, tid=r.tid, dur_ms=r.value,
                       status=schema.STATUS_OK if error is None else schema.STATUS_ERROR, error=error)

    def _instant(self, r: TitanLine, kind: str) -> Instant | Scalar:
        ts = r.time_us / 1e6
        if kind == METRIC and r.event_name is not None and r.value is not None:
            return Scalar(1, ts, "", None, None, None, r.step, r.relative_step, None, None, r.step_tags, r.tid, None,
                          {r.event_name: r.value})
        return Instant(v=1, ts=ts, name=kind, step=r.step, relative_step=r.relative_step, tags=r.step_tags,
                       tid=r.tid, attrs=_instant_attrs(r))


def _instant_attrs(r: TitanLine) -> dict[str, Any] | None:
    if r.task_name is None:
        return None if r.caller is None else {CALLER: r.caller}
    return {CALLER: r.caller, TASK: r.task_name}


def _error(kind: str, message: str | None) -> dict[str, Any]:
    """``{type, message}`` from their error line's message: ``[step N] <name>_error: <Type>: <text>``."""
    text = message or ""
    at = text.find(kind + ": ")
    if at >= 0:
        text = text[at + len(kind) + 2:]
    exc_type, sep, rest = text.partition(": ")
    if not sep:
        return {"type": "error", "message": text}
    return {"type": exc_type, "message": rest}


def decode(chunk: bytes | memoryview, path: Path, stream: Stream, report: Any) -> list[AnyRecord]:
    """The records of a buffer of their whole lines; ``report(index, reason)`` counts a bad line."""
    try:
        lines = TITAN_DECODER.decode_lines(chunk)
    except DECODE_ERRORS:
        lines = []
        for index, line in enumerate(bytes(chunk).split(b"\n")):
            if not line.strip():
                continue
            try:
                lines.append(TITAN_DECODER.decode(line))
            except DECODE_ERRORS as exc:
                report(index, "nested too deeply" if isinstance(exc, RecursionError) else str(exc))
    return stream.convert(lines)


def head(data: bytes) -> Head | None:
    """A process's identity from the first of their lines in ``data`` (None when none decodes)."""
    found: dict[str, Any] = {}
    fmt = FORMAT_TITAN
    for line in data.split(b"\n", 256)[:256]:
        try:
            rec = _HEAD_DECODER.decode(line)
        except DECODE_ERRORS:
            continue
        if not found:
            found["ts"] = rec.time_us / 1e6
            if rec.logger_name is not None and rec.logger_name.startswith(FORMAT_PIMM):
                fmt = FORMAT_PIMM
        for key, value in (("host", rec.host_name), ("pid", rec.pid), ("local_rank", rec.local_rank),
                           ("step", rec.step)):
            if value is not None and key not in found:
                found[key] = value
        if len(found) == 5:
            break
    # Their files carry no run id: the run is named by the format, so ``--run-id torchtitan`` picks them
    # out of a directory that holds ours too (docs/integrations-frameworks.md).
    return Head(**found, format=fmt, run_id=fmt) if found else None
