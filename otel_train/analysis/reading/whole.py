"""Reads of files at rest: whole processes as record batches, a process's first lines, its last bytes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from otel_train.analysis.reading import titan
from otel_train.analysis.reading.discovery import ProcessFiles, Warn, open_regular
from otel_train.analysis.reading.lines import CHUNK_BYTES, MAX_LINE_BYTES, BadLines, decode_chunk
from otel_train.analysis.reading.types import DECODE_ERRORS, RECORD_DECODER, RECORD_TYPES, AnyRecord, Head

class Reader:
    """Reads whole process files as record batches under the one bad-line rule.

    ``progress``, when given, is called with the number of bytes consumed after each chunk.
    """

    def __init__(self, *, warn: Warn | None = None, progress: Callable[[int], None] | None = None) -> None:
        self.bad = BadLines(warn)
        self._warn = self.bad.warn
        self._progress = progress

    @property
    def malformed_lines(self) -> int:
        """Lines skipped so far."""
        return self.bad.count

    def absorb(self, malformed: int, warnings: Iterable[str], nbytes: int) -> None:
        """Account for what another Reader (in a worker process) read: counts, warnings, progress."""
        self.bad.count += malformed
        for line in warnings:
            self._warn(line)
        if self._progress is not None:
            self._progress(nbytes)

    def batches(self, pf: ProcessFiles, start: tuple[int, int] = (0, 0)) -> Iterator[list[AnyRecord]]:
        """The process's records in file order, in lists of about a MiB of input each; from byte
        ``start[1]`` of segment ``start[0]`` on (a line start), when given."""
        for i, path in enumerate(pf.paths[start[0]:], start[0]):
            for offset, chunk in _chunks(path, self.bad, start[1] if i == start[0] else 0):
                yield decode_chunk(chunk, path, lambda o=offset, p=path: line_number(p, o), self.bad)
                if self._progress is not None:
                    self._progress(len(chunk))

    def records(self, pf: ProcessFiles) -> Iterator[dict]:
        """Every valid record as a plain dict with all its fields (for tools and notebooks)."""
        for path in pf.paths:
            for offset, chunk in _chunks(path, self.bad):
                good = decode_chunk(chunk, path, lambda o=offset, p=path: line_number(p, o), self.bad)
                if not good:
                    continue
                lines = bytes(chunk).split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        RECORD_DECODER.decode(line)
                    except DECODE_ERRORS:
                        continue  # already counted by decode_chunk
                    yield msgspec.json.decode(line)


def peek(pf: ProcessFiles, type_: Any = RECORD_TYPES, limit: int = 64) -> list[Any]:
    """The first ``limit`` readable lines of a process (oldest segment first) decoded as ``type_``.

    Reads at most 64 KiB per segment and counts nothing: the full read does the counting.
    """
    decoder = RECORD_DECODER if type_ is RECORD_TYPES else msgspec.json.Decoder(type_)
    out: list[Any] = []
    for path in pf.paths:
        try:
            with open_regular(path) as f:
                data = f.read(64 * 1024)
        except OSError:
            continue
        cut = data.rfind(b"\n") + 1
        rest = data[:cut].split(b"\n", limit - len(out))[-1]  # past the lines still wanted: not decoded
        cut -= len(rest)
        try:  # whole lines at once when all of them decode (the usual case: one C call); else line by line
            out.extend(decoder.decode_lines(data[:cut]))
        except DECODE_ERRORS:
            lines = data.split(b"\n")
        else:
            if len(out) >= limit:
                return out[:limit]
            lines = [data[cut:]]  # the segment's last line, cut short
        for line in lines:
            try:
                out.append(decoder.decode(line))
            except DECODE_ERRORS:
                continue
            if len(out) >= limit:
                return out
    return out


HEAD_QUICK_BYTES = 8 * 1024
""":func:`head` decodes this much of the oldest segment first; the rest of its 64 KiB only when a field is
still missing there and its name occurs in those bytes (1,024 heads: 0.14 s -> 0.08 s, the 64 KiB
still read for that search)."""
HEAD_DECODER = msgspec.json.Decoder(Head)


def head(pf: ProcessFiles) -> Head | None:
    """Identity fields of a process (host, pid, attempt, first step, ...): each field's first non-null
    value among its first readable lines (up to 256, within 64 KiB); None when none is readable."""
    quick = _quick_head(pf)
    if quick is not None:
        return quick
    return _first_values(peek(pf, Head, limit=256))


def _first_values(records: list[Head]) -> Head | None:
    found: dict[str, Any] = {}
    missing = list(Head.__struct_fields__)  # the fields still without a value: only those are looked at
    for rec in records:
        known = len(found)
        for name in missing:
            value = getattr(rec, name)
            if value is not None:
                found[name] = value
        if len(found) != known:
            missing = [n for n in missing if n not in found]
    return Head(**found) if found else None


def _quick_head(pf: ProcessFiles) -> Head | None:
    """:func:`head`'s answer from the first :data:`HEAD_QUICK_BYTES` of the oldest segment, when that is
    exactly what the 64 KiB read gives: the lines of the quick read are the first ones of the full read,
    so a field found there keeps its value, and a field missing there stays missing when its name does
    not occur in the rest of the 64 KiB (a raw search). None: decide by the full read."""
    try:
        with open_regular(pf.paths[0]) as f:
            data = f.read(64 * 1024)
    except OSError:
        return None
    if titan.is_titan(data):  # torchtitan's or pimm's file: its own fields name the process
        return titan.head(data[:data.rfind(b"\n") + 1])
    cut = data.rfind(b"\n", 0, HEAD_QUICK_BYTES) + 1
    if cut == 0:
        return None  # no whole line within the quick bytes
    try:
        records = HEAD_DECODER.decode_lines(data[:cut])
    except DECODE_ERRORS:
        return None
    if len(records) >= 256:
        return None
    got = _first_values(records)
    if got is None:
        return None
    missing = [name for name in Head.__struct_fields__ if getattr(got, name) is None]
    if missing and len(pf.paths) > 1:
        return None  # fewer than 256 lines in 64 KiB: the full read goes on into the next segment
    rest = data[cut:]
    if any(b'"%s"' % name.encode() in rest for name in missing):
        return None
    return got



def read_tail(pf: ProcessFiles, nbytes: int, bad: BadLines) -> tuple[list[AnyRecord], bool]:
    """The records in the last ``nbytes`` of a process's files, and whether that is all of them.

    Older segments are read only as far as the newer ones fall short of ``nbytes``. The first line of
    the window is dropped unless it starts a file (it is most likely cut); bad lines go to ``bad``.
    """
    pieces: list[tuple[Path, int, bytes]] = []
    left = nbytes
    for path in reversed(pf.paths):
        if left <= 0:
            break
        try:
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                start = max(0, size - left)
                f.seek(start)
                data = f.read(size - start)
        except OSError as exc:
            bad.warn(f"warning: {path}: cannot read ({exc.strerror or exc}); skipped")
            continue
        left -= len(data)
        pieces.append((path, start, data))
    pieces.reverse()
    whole = left > 0
    records: list[AnyRecord] = []
    for i, (path, start, data) in enumerate(pieces):
        if i == 0 and start > 0:
            cut = data.find(b"\n") + 1
            start, data = start + cut, data[cut:]
        records.extend(decode_chunk(data, path, lambda p=path, o=start: line_number(p, o), bad))
    return records, whole


def _chunks(path: Path, bad: BadLines, start: int = 0) -> Iterator[tuple[int, bytes | memoryview]]:
    """``(byte offset, buffer)`` pieces of a file, each ending at a line break (but the torn tail).

    A line cut by a block boundary is yielded alone (its pieces joined once, so a long line costs its
    length, not its length squared), and the bulk of every block goes out as a view, never copied. A
    line longer than :data:`MAX_LINE_BYTES` is never held: its bytes are dropped as they are read, up
    to its newline, and it is counted as one bad line.
    """
    try:
        f = open_regular(path)
    except OSError as exc:
        # A segment rotated away between listing and reading, or not a regular file: say so and go on.
        bad.warn(f"warning: {path}: cannot read ({exc.strerror or exc}); skipped")
        return
    with f:
        line = _LongLine(path, bad)
        if start:
            f.seek(start)
            line.offset = start
        while True:
            try:
                block = f.read(CHUNK_BYTES)
            except OSError as exc:
                bad.warn(f"warning: {path}: read failed at byte {line.end} ({exc.strerror or exc}); rest skipped")
                return
            if not block:
                break
            cut = block.rfind(b"\n")
            if cut < 0:
                line.add(block)
                continue
            start = 0
            if line.size or line.skipping:
                start = block.find(b"\n") + 1
                joined = line.finish(block[:start])
                if joined is not None:
                    yield line.offset, joined
                line.offset += line.taken
            if start <= cut:
                yield line.offset, memoryview(block)[start : cut + 1]
                line.offset += cut + 1 - start
            line.add(block[cut + 1 :])
        if line.size and not line.skipping:
            yield line.offset, b"".join(line.pieces)


class _LongLine:
    """The pieces of a line that a block boundary cut, kept up to :data:`MAX_LINE_BYTES`; past that
    the line is counted as bad once and its further bytes only counted (``skipping``)."""

    __slots__ = ("path", "bad", "offset", "pieces", "size", "skipping", "taken")

    def __init__(self, path: Path, bad: BadLines) -> None:
        self.path, self.bad = path, bad
        self.offset = 0  # where the current line starts
        self.pieces: list[bytes] = []
        self.size = 0  # bytes held in pieces, or counted past the limit while skipping
        self.skipping = False
        self.taken = 0  # length of the line the last finish() ended

    @property
    def end(self) -> int:
        return self.offset + self.size

    def add(self, piece: bytes) -> None:
        if not piece:
            return
        self.size += len(piece)
        if self.skipping:
            return
        self.pieces.append(piece)
        if self.size > MAX_LINE_BYTES:
            self.pieces = []
            self.skipping = True
            at = self.offset
            self.bad.report(self.path, lambda: line_number(self.path, at),
                            f"line longer than {MAX_LINE_BYTES >> 20} MiB, not read")

    def finish(self, last: bytes) -> bytes | None:
        """End the line with ``last`` (up to its newline): the whole line, or None when it was skipped."""
        self.add(last)
        self.taken = self.size
        joined = None if self.skipping else b"".join(self.pieces)
        self.pieces, self.size, self.skipping = [], 0, False
        return joined


def line_number(path: Path, offset: int) -> int:
    """1-based number of the line starting at byte ``offset`` (only needed for a warning, so rarely)."""
    count = 1
    try:
        with open_regular(path) as f:
            while offset > 0:
                block = f.read(min(offset, CHUNK_BYTES))
                if not block:
                    break
                count += block.count(b"\n")
                offset -= len(block)
    except OSError:
        pass
    return count
