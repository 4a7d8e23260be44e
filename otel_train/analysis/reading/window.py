"""A step window of a process's files, found by bisection: the byte ranges that hold steps ``A..B``.

Records carry ``step`` and are written in ``seq`` order, so within a process the step never goes
back (but for ``comm.*`` records, which the recorder's thread writes after later steps' records, and
records before the first step, which carry none). :func:`plan` finds, per segment (oldest first,
each judged by its first and last records), the last line before step ``A`` and the first line past
step ``B + 1`` by bisection on byte offsets: each probe reads one block and decodes the step of its
first whole line that carries one. What is read (docs/analysis.md, "Reading"):

* the **head**: the oldest segment's records before its first step (spans that enclose every step,
  such as a ``train`` span, start there: the runtime stamps every record after the first step with a
  step);
* the **window**: from the last line before step ``A`` to the first past step ``B + 1``, and
  :data:`MARGIN_BYTES` more (late ``comm.*`` records);
* the **tail**: the last :data:`TAIL_BYTES` of the active file (how the process ended);
* the **ends** of head spans still open after those (:func:`find_ends`, a raw scan backwards from
  the tail: no decode).

A process whose probes see the step go back (steps that repeat per epoch) gets ``None``: the caller
reads it whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from otel_train import schema
from otel_train.analysis.reading.discovery import ProcessFiles, open_regular
from otel_train.analysis.reading.lines import CHUNK_BYTES, MAX_LINE_BYTES, BadLines, decode_chunk
from otel_train.analysis.reading.types import DECODE_ERRORS, RECORD_DECODER, AnyRecord, SpanEnd
from otel_train.analysis.reading.whole import line_number

PROBE_BYTES = 16 << 10
"""What one probe reads at a time; the bisection stops when its bounds are this close."""
PROBE_LIMIT = 2 << 20
"""A probe gives up (as if at the end of the file) after this many bytes without a step."""
MARGIN_BYTES = 64 << 10
"""Read past the first line of step ``B + 2``: ``comm.*`` records of the window written late."""
TAIL_BYTES = 16 << 10
"""The end of the active file, always read: how the process ended (``process_end``, its last step and
event). Spans open at the end matter only inside the window, which its own range covers (``restrict``
drops the others). It was 64 KiB: with 1,024 small processes that was a third of what a 10-step
window decoded."""


class _Probe(msgspec.Struct, gc=False):
    step: int | None = None
    name: str = ""
    epoch: int | None = None


_probe_decoder = msgspec.json.Decoder(_Probe)


@dataclass(frozen=True, slots=True)
class Range:
    """Bytes ``start..end`` (line starts) of segment ``index`` (``path``); ``gap``: bytes before it
    (in this segment or an older one) are not read."""

    index: int
    path: Path
    start: int
    end: int
    gap: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """What to read of one process for a step window (see the module doc)."""

    ranges: tuple[Range, ...]
    first_ts: float | None  # the oldest segment's first record's time: an end that began before it is an orphan
    ends_from: tuple[int, int]  # (segment, offset) where the head spans' ends are searched from (backwards)...
    ends_to: tuple[int, int]  # ...down to here (the window's end)

    @property
    def nbytes(self) -> int:
        """Bytes the plan reads."""
        return sum(r.end - r.start for r in self.ranges)


class _Segment:
    """One open segment: probes by byte offset, each remembered (the monotone check reads them)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.probes: dict[int, tuple[int, int] | None] = {}

    def line_start(self, pos: int) -> int:
        """The first line start at or after ``pos``."""
        if pos <= 0 or pos >= self.size:
            return max(0, min(pos, self.size))
        at = pos - 1
        while at < self.size:
            block = os.pread(self.fd, PROBE_BYTES, at)
            if not block:
                break
            nl = block.find(b"\n")
            if nl >= 0:
                return at + nl + 1
            at += len(block)
        return self.size

    def probe(self, pos: int) -> tuple[int, int] | None:
        """(line start, step) of the first record at or after ``pos`` that carries a step and is not a
        ``comm.*`` record; None when there is none before the end (or within :data:`PROBE_LIMIT`)."""
        if pos in self.probes:
            return self.probes[pos]
        line = self.line_start(pos)
        found = None
        read = 0
        while line < self.size and read < PROBE_LIMIT and found is None:
            block = os.pread(self.fd, PROBE_BYTES, line)
            read += len(block)
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a block: skip it
                line = self.line_start(line + len(block))
                continue
            found, line = _first_step(block[:cut], line)
        self.probes[pos] = found
        return found

    def last_step(self) -> int | None:
        """The step of the last record that carries one (within the last :data:`PROBE_LIMIT` bytes)."""
        for span in (PROBE_BYTES, PROBE_LIMIT):
            start = max(0, self.size - span)
            block = os.pread(self.fd, self.size - start, start)
            steps = _steps(block if start == 0 else block[block.find(b"\n") + 1:])
            if steps:
                return steps[-1]
            if start == 0:
                break
        return None

    def bound(self, target: int, lo: int = 0) -> tuple[int, int]:
        """(a line start before which every record is of a step below ``target``, a position at or after
        which every record is of ``target`` or later), found by bisection from ``lo``."""
        p = self.probe(lo)
        if p is None or p[1] >= target:
            return lo, lo
        lo, hi = p[0], self.size
        while hi - lo > PROBE_BYTES:
            mid = (lo + hi) // 2
            p = self.probe(mid)
            if p is None or p[1] >= target:
                hi = mid
            else:
                lo = min(p[0], hi)
        return lo, hi

    def monotone(self) -> bool:
        """Whether every probe so far saw the step grow with the offset."""
        seen = sorted(p for p in self.probes.values() if p is not None)
        return all(a[1] <= b[1] for a, b in zip(seen, seen[1:]))


def _first_step(block: bytes, base: int) -> tuple[tuple[int, int] | None, int]:
    """The first (line start, step) in a buffer of whole lines at ``base``, and where it ends."""
    at = 0
    while at < len(block):
        nl = block.find(b"\n", at)
        nl = len(block) if nl < 0 else nl
        try:
            rec = _probe_decoder.decode(block[at:nl])
        except DECODE_ERRORS:
            rec = None
        if rec is not None and rec.step is not None and not rec.name.startswith(schema.COMM_PREFIX):
            return (base + at, rec.step), base + len(block)
        at = nl + 1
    return None, base + len(block)


def _steps(block: bytes) -> list[int]:
    out = []
    for line in block.split(b"\n"):
        try:
            rec = _probe_decoder.decode(line)
        except DECODE_ERRORS:
            continue
        if rec.step is not None and not rec.name.startswith(schema.COMM_PREFIX):
            out.append(rec.step)
    return out


def _first_ts(seg: _Segment) -> float | None:
    block = os.pread(seg.fd, PROBE_BYTES, 0)
    for line in block.split(b"\n"):
        try:
            return RECORD_DECODER.decode(line).ts
        except DECODE_ERRORS:
            continue
    return None


def plan(pf: ProcessFiles, lo: int, hi: int) -> Plan | None:
    """The byte ranges of ``pf`` that hold steps ``lo..hi`` (see the module doc); None when the
    process's steps are not monotone (read it whole), or a segment cannot be opened."""
    files = []
    try:
        for path in pf.paths:
            files.append(open_regular(path))
        segs = [_Segment(f.fileno(), os.fstat(f.fileno()).st_size) for f in files]
        if _several_epochs(segs):
            return None  # steps may restart every epoch: only a whole read numbers them (docs/analysis.md)
        return _plan(pf, segs, lo, hi)
    except OSError:
        return None
    finally:
        for f in files:
            f.close()


def _several_epochs(segs: list[_Segment]) -> bool:
    """Whether the process's steps restart with a new epoch: its first and its last epoch boundary
    (found by bisection: epochs never go back in a process's files) each see the step go back.
    Such steps the span model numbers globally from the first record on (docs/analysis.md, "The span
    model"), so only a whole read can number them; steps that keep growing across epochs are windowed."""
    first, last = _epoch_of(segs[0], 0, first=True), _epoch_of(segs[-1], segs[-1].size, first=False)
    if first is None or last is None or first == last:
        return False
    return _restarts_at(segs, first + 1) or _restarts_at(segs, last)


def _epoch_of(seg: _Segment, at: int, *, first: bool) -> int | None:
    """The epoch of the first record at or after ``at`` (``first``), or of the last record before it."""
    block = os.pread(seg.fd, PROBE_BYTES, at if first else max(0, at - PROBE_BYTES))
    lines = block.split(b"\n") if first else block.split(b"\n")[1 if at > PROBE_BYTES else 0:][::-1]
    got = next(_epoch_steps(lines), None)
    return None if got is None else got[0]


def _epoch_steps(lines: Iterable[bytes]) -> Iterator[tuple[int, int]]:
    """(epoch, step) of each line that carries both (not ``comm.*``), decoded only as far as the caller
    iterates: a probe wants the first of a block, the boundary's test the records up to it."""
    for line in lines:
        try:
            rec = _probe_decoder.decode(line)
        except DECODE_ERRORS:
            continue
        if rec.epoch is not None and rec.step is not None and not rec.name.startswith(schema.COMM_PREFIX):
            yield rec.epoch, rec.step


def _restarts_at(segs: list[_Segment], epoch: int) -> bool:
    """Whether the first step of ``epoch`` is at or below the last step of the epoch before it."""
    before: int | None = None
    for seg in segs:
        lo, hi = 0, seg.size
        while hi - lo > PROBE_BYTES:  # bisection: records before ``lo`` are of earlier epochs
            mid = seg.line_start((lo + hi) // 2)
            got = next(_epoch_steps(os.pread(seg.fd, PROBE_BYTES, mid).split(b"\n")[:-1]), None)
            if got is None or got[0] >= epoch:
                hi = mid
            else:
                lo = mid
        for e, step in _epoch_steps(_lines(seg, lo, min(seg.size, lo + PROBE_LIMIT))):
            if e >= epoch:
                return before is not None and step <= before
            before = step
    return False


def _lines(seg: _Segment, lo: int, hi: int) -> Iterator[bytes]:
    """The lines of bytes ``lo..hi``, read a probe's block at a time, only as far as the caller iterates."""
    carry = b""
    while lo < hi:
        block = os.pread(seg.fd, min(PROBE_BYTES, hi - lo), lo)
        if not block:
            break
        lo += len(block)
        lines = (carry + block).split(b"\n")
        carry = lines.pop()
        yield from lines
    if carry:
        yield carry


def _plan(pf: ProcessFiles, segs: list[_Segment], lo: int, hi: int) -> Plan | None:
    spans: list[tuple[int, int, int]] = []  # (segment, start, end), then merged
    last_prev = -1
    head_end = 0
    for i, seg in enumerate(segs):
        first = seg.probe(0)
        last = seg.last_step()
        if i == 0:
            head_end = seg.size if first is None else first[0]
            if head_end:
                spans.append((0, 0, head_end))
        if first is None or last is None:
            continue
        if first[1] < last_prev or last < first[1]:
            return None
        last_prev = last
        if last < lo or first[1] > hi + 1:
            continue
        start, _ = seg.bound(lo)
        _, stop = seg.bound(hi + 2, start)
        if not seg.monotone():
            return None
        stop = seg.probe(stop)[0] if seg.probe(stop) is not None else seg.size  # type: ignore[index]
        spans.append((i, start, seg.line_start(min(seg.size, stop + MARGIN_BYTES))))
    window_end = (spans[-1][0], spans[-1][2]) if spans else (0, head_end)
    tail = segs[-1]
    tail_start = tail.line_start(max(0, tail.size - TAIL_BYTES))
    spans.append((len(segs) - 1, tail_start, tail.size))
    ranges = _merge(pf, spans, [s.size for s in segs])
    return Plan(tuple(ranges), _first_ts(segs[0]), (len(segs) - 1, tail_start), window_end)


def _merge(pf: ProcessFiles, spans: list[tuple[int, int, int]], sizes: list[int]) -> list[Range]:
    """The spans sorted and merged per segment, each marked with whether bytes before it are unread."""
    spans.sort()
    merged: list[list[int]] = []
    for i, start, end in spans:
        if merged and merged[-1][0] == i and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([i, start, end])
    out: list[Range] = []
    at = (0, 0)  # everything before this (segment, offset) is read, while no gap was seen
    gap = False
    for i, start, end in merged:
        while at[0] < i and at[1] >= sizes[at[0]]:
            at = (at[0] + 1, 0)
        gap = gap or (i, start) != at
        out.append(Range(i, pf.paths[i], start, end, gap))
        at = (i, end)
    return out


def read_range(r: Range, bad: BadLines) -> list[AnyRecord]:
    """The records of one range, under the one bad-line rule (torn lines counted, warned once)."""
    out: list[AnyRecord] = []
    try:
        f = open_regular(r.path)
    except OSError as exc:
        bad.warn(f"warning: {r.path}: cannot read ({exc.strerror or exc}); skipped")
        return out
    with f:
        f.seek(r.start)
        pos, carry = r.start, b""
        while pos < r.end:
            block = f.read(min(CHUNK_BYTES, r.end - pos))
            if not block:
                break
            pos += len(block)
            data = carry + block if carry else block
            cut = data.rfind(b"\n") + 1 if pos < r.end else len(data)
            if cut == 0 and len(data) <= MAX_LINE_BYTES:
                carry = data
                continue
            at = pos - len(data)
            out.extend(decode_chunk(data[:cut] if cut else data, r.path, lambda p=r.path, o=at: line_number(p, o), bad))
            carry = data[cut:] if cut else b""
    return out


def find_ends(pf: ProcessFiles, plan: Plan, span_ids: Iterable[str]) -> list[AnyRecord]:
    """The ``span_end`` records of ``span_ids`` between the window and the tail, searched backwards from
    the tail as raw bytes (``"span_id":"<id>"`` on a ``span_end`` line), in file order."""
    wanted = {sid: b'"span_id":"%s"' % sid.encode() for sid in span_ids}
    found: list[tuple[int, int, AnyRecord]] = []
    (last, top), (first, bottom) = plan.ends_from, plan.ends_to
    for i in range(last, first - 1, -1):
        if not wanted:
            break
        hi = top if i == last else None
        lo = bottom if i == first else 0
        found.extend(_scan_back(pf.paths[i], i, lo, hi, wanted))
    found.sort(key=lambda t: (t[0], t[1]))
    return [rec for _, _, rec in found]


def _scan_back(path: Path, index: int, lo: int, hi: int | None, wanted: dict[str, bytes]
               ) -> list[tuple[int, int, AnyRecord]]:
    out: list[tuple[int, int, AnyRecord]] = []
    try:
        f = open_regular(path)
    except OSError:
        return out
    with f:
        end = os.fstat(f.fileno()).st_size if hi is None else hi
        while end > lo and wanted:
            start = max(lo, end - CHUNK_BYTES)
            block = os.pread(f.fileno(), end - start, start)
            first = 0 if start == lo else block.find(b"\n") + 1
            for sid, needle in list(wanted.items()):
                at = block.rfind(needle, first)
                while at >= 0:
                    line = block[block.rfind(b"\n", 0, at) + 1:(block.find(b"\n", at) + 1 or len(block) + 1) - 1]
                    rec = _decode(line)
                    if type(rec) is SpanEnd:
                        out.append((index, start + at, rec))
                        del wanted[sid]
                        break
                    at = block.rfind(needle, first, at)
            end = start + first if first else start
    return out


def _decode(line: bytes) -> AnyRecord | None:
    try:
        return RECORD_DECODER.decode(line)
    except DECODE_ERRORS:
        return None
