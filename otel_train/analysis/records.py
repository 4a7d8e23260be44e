"""Trace files to validated records: discovery, safe opening, one decoder, one bad-line rule.

A run directory holds ``structured_logs/<source>.global_rank_<rank>.<stamp>-<rand>.jsonl[.N]``; one
``<stamp>-<rand>`` instance is one process. Segments are read oldest first (``.N`` … ``.1``, then
the active file). Only regular files are opened, non-blocking, so a FIFO or a directory named like
a trace file is skipped with a warning instead of hanging the reader.

Every reader (whole files for summarize, stats, export and push; growing files for ``watch`` and
``push --follow``) decodes lines with the same typed decoder (:data:`RECORD_TYPES`) and the same
rule (:class:`BadLines`): a line that is not a schema-v1 record (torn, garbage, binary, too deeply
nested, or a field of the wrong type or out of range: docs/schema.md) is skipped, counted, and
reported once per file as ``file:line``.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any, ClassVar, TypeVar

import msgspec

from otel_train import schema, sketch

_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

MAX_STEP = 2**53
"""Largest step, epoch or iteration a record may carry (the largest integer JSON keeps exact)."""
MAX_TS = 1e11
"""Largest ``ts`` accepted (the year 5138): anything later is a broken clock or a broken line."""
_MAX_ID = 2**63 - 1
_MAX_DUR_MS = 1e12

_CHUNK_BYTES = 1 << 20
MAX_LINE_BYTES = 8 << 20
"""Longest line a reader decodes (the runtime's largest records, stall stacks, are well under 1 MiB).
A longer line is skipped as it is read, never held, and counted as malformed (docs/schema.md)."""

T = TypeVar("T")

Warn = Callable[[str], None]


class TraceReadError(Exception):
    """A path that holds no readable trace files; the message is one line (what, where, how to fix)."""


def warn_to_stderr(message: str) -> None:
    """The default warning sink: one line on stderr."""
    print(message, file=sys.stderr)


def _quiet(message: str) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Files


@dataclass(frozen=True, slots=True)
class ProcessFiles:
    """The files of one process: ``paths`` are its segments, oldest first."""

    source: str
    rank: int
    instance: str
    paths: tuple[Path, ...]

    @property
    def size(self) -> int:
        """Total bytes on disk (0 for segments that vanished meanwhile)."""
        total = 0
        for p in self.paths:
            try:
                total += p.stat().st_size
            except OSError:
                pass
        return total

    @property
    def key(self) -> tuple[str, int, str]:
        """(source, rank, instance): stable while the process rotates its files."""
        return (self.source, self.rank, self.instance)


def logs_dir(path: str | Path) -> Path:
    """The ``structured_logs`` directory for a run dir or the logs dir itself; raises TraceReadError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise TraceReadError(f"{p}: no such directory; pass a run directory or its {schema.STRUCTURED_LOGS_DIR}/")
    if not p.is_dir():
        raise TraceReadError(f"{p}: not a directory; pass a run directory or its {schema.STRUCTURED_LOGS_DIR}/")
    sub = p / schema.STRUCTURED_LOGS_DIR
    return sub if sub.is_dir() else p


def scan_process_files(d: Path, warn: Warn = _quiet) -> list[ProcessFiles]:
    """The trace files in the logs directory ``d``, grouped by process; [] when there are none.

    Entries named like trace files that are not regular files (a FIFO, a directory, a socket) are
    skipped with a warning: opening one could block forever.
    """
    try:
        entries = list(os.scandir(d))
    except OSError as exc:
        raise TraceReadError(f"{d}: cannot list directory ({exc.strerror or exc})") from None
    groups: dict[tuple[str, int, str], list[tuple[int, Path]]] = {}
    for entry in entries:
        m = schema.FILE_RE.match(entry.name)
        if m is None:
            continue
        try:
            regular = entry.is_file()  # follows a symlink; stat never blocks on a FIFO
        except OSError:
            regular = False
        if not regular:
            warn(f"warning: {entry.path}: not a regular file; skipped")
            continue
        key = (m["source"], int(m["rank"]), f"{m['stamp']}-{m['rand']}")
        segment = int(m["segment"]) if m["segment"] is not None else 0
        groups.setdefault(key, []).append((segment, Path(entry.path)))
    out = [
        ProcessFiles(source, rank, instance, tuple(p for _, p in sorted(segs, key=lambda s: -s[0])))
        for (source, rank, instance), segs in groups.items()
    ]
    out.sort(key=lambda pf: (pf.rank, pf.source, pf.instance))
    return out


def find_process_files(path: str | Path, warn: Warn = warn_to_stderr) -> list[ProcessFiles]:
    """Group a run's trace files by process, sorted by (rank, source, instance); raises TraceReadError."""
    d = logs_dir(path)
    out = scan_process_files(d, warn)
    if not out:
        raise TraceReadError(
            f"{d}: no trace files (expected <source>.global_rank_<N>.<YYYYmmdd-HHMMSS>-<rand>.jsonl); "
            "was tracing enabled with this save_path?"
        )
    return out


def open_regular(path: Path) -> IO[bytes]:
    """Open ``path`` for reading without ever blocking in ``open`` (O_NONBLOCK); raises OSError,
    with ``EINVAL``-style text "not a regular file" for anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", str(path))
        return open(fd, "rb", buffering=0, closefd=True)
    except BaseException:
        os.close(fd)
        raise


# ---------------------------------------------------------------------------------------------
# Records


_Ts = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TS)]
_Step = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
_Relative = Annotated[int, msgspec.Meta(ge=-MAX_STEP, le=MAX_STEP)]
_Id = Annotated[int, msgspec.Meta(ge=0, le=_MAX_ID)]
_Dur = Annotated[float, msgspec.Meta(ge=-_MAX_DUR_MS, le=_MAX_DUR_MS)]


class Record(msgspec.Struct, tag_field=schema.KIND, gc=False):
    """The fields of a schema-v1 record that readers use, typed and range-checked (docs/schema.md).

    Concrete records are :class:`SpanStart`, :class:`SpanEnd`, :class:`Instant` and :class:`Scalar`,
    chosen by ``kind``; other fields are skipped by the decoder.
    """

    v: int
    ts: _Ts
    name: str = ""
    span_id: str | None = None
    parent_span_id: str | None = None
    trace_id: str | None = None
    step: _Step | None = None
    relative_step: _Relative | None = None
    epoch: _Step | None = None
    iteration: _Step | None = None
    tags: list[str] | None = None
    tid: _Id | None = None
    attrs: dict[str, Any] | None = None

    kind: ClassVar[str] = ""

    @property
    def event(self) -> str:
        """The ``event`` field as the sink writes it (``<name>_start``, ``<name>_end``, the instant's name)."""
        return self.name or self.kind


class SpanStart(Record, tag=schema.SPAN_START):
    """A span began."""

    kind: ClassVar[str] = schema.SPAN_START

    @property
    def event(self) -> str:
        return self.name + schema.START_SUFFIX


class SpanEnd(Record, tag=schema.SPAN_END):
    """A span ended: ``dur_ms``, ``status`` (ok, error, incomplete) and ``error`` when it raised."""

    dur_ms: _Dur | None = None
    status: str | None = None
    error: dict[str, Any] | None = None

    kind: ClassVar[str] = schema.SPAN_END

    @property
    def event(self) -> str:
        return self.name + schema.END_SUFFIX

    def began(self) -> float:
        """When the span began by this record alone: ``dur_ms`` before its end, never before 1970 (a
        hostile duration would give a time no OTLP or Perfetto field can hold)."""
        return max(0.0, self.ts - (self.dur_ms or 0.0) / 1000.0)


class Instant(Record, tag=schema.INSTANT):
    """A point event (the runtime's own: process_start/end, exception, heartbeat, stall, ...)."""

    kind: ClassVar[str] = schema.INSTANT


class Scalar(Record, tag=schema.SCALAR):
    """Numeric values at a point in time."""

    values: dict[str, Any] | None = None

    kind: ClassVar[str] = schema.SCALAR


AnyRecord = SpanStart | SpanEnd | Instant | Scalar
RECORD_TYPES = AnyRecord
"""What every reader decodes a line into."""


class Head(msgspec.Struct, gc=False):
    """Who wrote a file: the identity fields of its first records (see :func:`head`)."""

    ts: _Ts
    attempt: Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)] | None = None
    host: str | None = None
    pid: _Id | None = None
    local_rank: _Step | None = None
    world_size: _Step | None = None
    run_id: str | None = None
    job_id: str | None = None
    step: _Step | None = None  # the first step the process recorded


class DigestFile(msgspec.Struct, gc=False):
    """Where a digest was taken: the trace file's inode and its size then."""

    ino: Annotated[int, msgspec.Meta(ge=0)]
    size: Annotated[int, msgspec.Meta(ge=0)]


class DigestSpan(msgspec.Struct, gc=False):
    """A span open when a digest was taken."""

    span_id: str
    name: str
    start_ts: _Ts
    parent_span_id: str | None = None
    trace_id: str | None = None
    step: _Step | None = None
    tid: _Id | None = None

    def start_record(self) -> SpanStart:
        """The span's start as the record the span model pairs."""
        return SpanStart(v=1, ts=self.start_ts, name=self.name, span_id=self.span_id,
                         parent_span_id=self.parent_span_id, trace_id=self.trace_id, step=self.step, tid=self.tid)


_Bucket = Annotated[int, msgspec.Meta(ge=0, lt=sketch.BUCKETS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_ID)]
_TotalMs = Annotated[float, msgspec.Meta(ge=0.0, le=_MAX_DUR_MS * _MAX_DUR_MS)]


class DigestPhase(msgspec.Struct, gc=False):
    """One span name's closed durations in a digest: count, total and longest ms, and sketch buckets.

    Every field is range-checked like a record's: a bucket index past the sketch's last bucket (whose
    value no float holds), a negative or unbounded total, is a digest that is not ours, skipped whole."""

    count: _Count
    sum_ms: _TotalMs
    max_ms: Annotated[float, msgspec.Meta(ge=0.0, le=_MAX_DUR_MS)]
    buckets: dict[_Bucket, _Count]


class Digest(msgspec.Struct, gc=False):
    """A process's digest (docs/schema.md, "Digests")."""

    v: int
    ts: _Ts
    seq: int
    file: DigestFile
    open: list[DigestSpan]
    gamma: float
    phases: dict[str, DigestPhase]


_digest_decoder = msgspec.json.Decoder(Digest)


def read_digest(pf: ProcessFiles, warn: Warn) -> Digest | None:
    """The digest beside a process's active file; None when there is none, with a warning when it is
    unreadable or malformed (the runtime replaces it atomically, so that is not a write in progress)."""
    path = Path(schema.digest_file_name(str(pf.paths[-1])))
    try:
        with open_regular(path) as f:
            data = f.read(16 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        warn(f"warning: {path}: cannot read ({exc.strerror or exc}); phases of this process skipped")
        return None
    try:
        return _digest_decoder.decode(data)
    except _DECODE_ERRORS as exc:
        warn(f"warning: {path}: not a digest ({_one_line(str(exc))}); phases of this process skipped")
        return None


def ended_since(pf: ProcessFiles, ino: int, size: int, span_ids: Iterable[str]) -> set[str] | None:
    """Which of ``span_ids`` a process ended after its active file (inode ``ino``) was ``size`` long;
    None when that segment is gone (rotated away).

    A scan of raw bytes, not a decode: each id's ``"span_id":"<id>"`` (the quote before it rules out
    ``parent_span_id``) on a ``span_end`` line. What the runtime wrote after a digest is at most
    ``digest_s`` of records, so this stays cheap however big the files are.
    """
    wanted = {sid: b'"span_id":"%s"' % sid.encode() for sid in span_ids}
    paths = list(pf.paths)
    for i, path in enumerate(paths):
        try:
            if path.stat().st_ino == ino:
                break
        except OSError:
            continue
    else:
        return None
    ended: set[str] = set()
    for j, path in enumerate(paths[i:]):
        _scan_ends(path, size if j == 0 else 0, wanted, ended)
    return ended


def _scan_ends(path: Path, offset: int, wanted: dict[str, bytes], ended: set[str]) -> None:
    try:
        f = open_regular(path)
    except OSError:
        return
    with f:
        f.seek(offset)
        carry = b""
        while block := f.read(_CHUNK_BYTES):
            data = carry + block
            cut = data.rfind(b"\n") + 1
            data, carry = data[:cut], data[cut:]
            if len(carry) > MAX_LINE_BYTES:
                carry = b""  # a line past the limit is no record: never held
            for sid, needle in wanted.items():
                at = data.find(needle)
                while at >= 0 and sid not in ended:
                    line = data[data.rfind(b"\n", 0, at) + 1:data.find(b"\n", at)]
                    if b'"kind":"span_end"' in line:
                        ended.add(sid)
                    at = data.find(needle, at + 1)


class BadLines:
    """The one rule for lines that are not records: skip, count, and warn once per file (``file:line``)."""

    def __init__(self, warn: Warn | None = None, *, collect: bool = False) -> None:
        self.count = 0
        self.warnings: list[Any] = []  # collected: strings, or _BadLineWarning until absorbed
        # collect=True keeps the warnings for a later absorb() (a read that may be thrown away).
        self.warn = self.warnings.append if collect else (warn or warn_to_stderr)
        self._collect = collect
        self._warned: set[Path] = set()

    def absorb(self, other: BadLines) -> None:
        """Take over the count and the collected warnings of ``other``."""
        self.count += other.count
        for line in other.warnings:
            self.warn(str(line))

    def report(self, path: Path, line_no: int | Callable[[], int], reason: str) -> None:
        """Count one bad line; warn when it is the first of ``path``."""
        self.count += 1
        if path not in self._warned:
            self._warned.add(path)
            warning = _BadLineWarning(path, line_no, reason)
            # Collected, its line number (a count of the line breaks before it) waits for absorb():
            # a read that is thrown away (a --fast window) never pays for it.
            self.warn(warning if self._collect else str(warning))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _BadLineWarning:
    path: Path
    line_no: int | Callable[[], int]
    reason: str

    def __str__(self) -> str:
        where = self.line_no() if callable(self.line_no) else self.line_no
        return (f"warning: {self.path}:{where}: skipped malformed line ({_one_line(self.reason)}); "
                "further bad lines in this file are only counted")


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."




_record_decoder = msgspec.json.Decoder(RECORD_TYPES)


def decode_chunk(
    chunk: bytes | memoryview, path: Path, first_line: Callable[[], int], bad: BadLines
) -> list[AnyRecord]:
    """The records of a buffer of whole lines; bad lines go to ``bad``.

    ``first_line()`` gives the 1-based number of the chunk's first line (asked only for a warning).
    A line longer than :data:`MAX_LINE_BYTES` is bad whatever it holds (as when a file is read whole).
    """
    if len(chunk) > MAX_LINE_BYTES:
        return _decode_long_chunk(memoryview(chunk), path, first_line, bad)
    return _decode_lines(chunk, path, first_line, bad)


def _decode_lines(chunk: bytes | memoryview, path: Path, first_line: Callable[[], int], bad: BadLines) -> list[AnyRecord]:
    try:
        return _record_decoder.decode_lines(chunk)
    except _DECODE_ERRORS:
        pass
    # Something in this chunk is bad: decode line by line to lose only the bad lines.
    items: list[AnyRecord] = []
    for index, line in enumerate(bytes(chunk).split(b"\n")):
        if not line.strip():
            continue
        try:
            items.append(_record_decoder.decode(line))
        except _DECODE_ERRORS as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            bad.report(path, lambda i=index: first_line() + i, reason)
    return items


def _decode_long_chunk(chunk: memoryview, path: Path, first_line: Callable[[], int], bad: BadLines) -> list[AnyRecord]:
    """:func:`decode_chunk` for a buffer that may hold lines past the limit: they are found in one pass
    (each step jumps to the last line break within the limit, so a step covers about the limit's bytes)
    and counted; the lines between them are decoded."""
    data = chunk.obj if isinstance(chunk.obj, bytes) and len(chunk.obj) == len(chunk) else bytes(chunk)
    out: list[AnyRecord] = []
    good = pos = 0
    while pos < len(data):
        brk = data.rfind(b"\n", pos, pos + MAX_LINE_BYTES + 1)
        if brk >= 0:
            pos = brk + 1
            continue
        if len(data) - pos <= MAX_LINE_BYTES:
            break  # a torn last line within the limit: decoded (and counted) like any other
        if good < pos:
            out.extend(_decode_lines(chunk[good:pos], path, lambda g=good: first_line() + data.count(b"\n", 0, g), bad))
        end = data.find(b"\n", pos)
        bad.report(path, lambda p=pos: first_line() + data.count(b"\n", 0, p),
                   f"line longer than {MAX_LINE_BYTES >> 20} MiB, not read")
        good = pos = len(data) if end < 0 else end + 1
    if good < len(data):
        out.extend(_decode_lines(chunk[good:], path, lambda: first_line() + data.count(b"\n", 0, good), bad))
    return out


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

    def batches(self, pf: ProcessFiles) -> Iterator[list[AnyRecord]]:
        """The process's records in file order, in lists of about a MiB of input each."""
        for path in pf.paths:
            for offset, chunk in _chunks(path, self.bad):
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
                        _record_decoder.decode(line)
                    except _DECODE_ERRORS:
                        continue  # already counted by decode_chunk
                    yield msgspec.json.decode(line)


def peek(pf: ProcessFiles, type_: Any = RECORD_TYPES, limit: int = 64) -> list[Any]:
    """The first ``limit`` readable lines of a process (oldest segment first) decoded as ``type_``.

    Reads at most 64 KiB per segment and counts nothing: the full read does the counting.
    """
    decoder = msgspec.json.Decoder(type_)
    out: list[Any] = []
    for path in pf.paths:
        try:
            with open_regular(path) as f:
                data = f.read(64 * 1024)
        except OSError:
            continue
        for line in data.split(b"\n"):
            try:
                out.append(decoder.decode(line))
            except _DECODE_ERRORS:
                continue
            if len(out) >= limit:
                return out
    return out


def head(pf: ProcessFiles) -> Head | None:
    """Identity fields of a process (host, pid, attempt, first step, ...): each field's first non-null
    value among its first readable lines (up to 256, within 64 KiB); None when none is readable."""
    found: dict[str, Any] = {}
    for rec in peek(pf, Head, limit=256):
        for name in rec.__struct_fields__:
            value = getattr(rec, name)
            if value is not None and name not in found:
                found[name] = value
    return Head(**found) if found else None


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


def _chunks(path: Path, bad: BadLines) -> Iterator[tuple[int, bytes | memoryview]]:
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
        while True:
            try:
                block = f.read(_CHUNK_BYTES)
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
                block = f.read(min(offset, _CHUNK_BYTES))
                if not block:
                    break
                count += block.count(b"\n")
                offset -= len(block)
    except OSError:
        pass
    return count


# ---------------------------------------------------------------------------------------------
# Growing files


@dataclass(slots=True)
class _Segment:
    offset: int = 0
    lines: int = 0  # complete lines consumed, for warnings
    partial: bytes = b""
    skipping: bool = False  # inside a line past MAX_LINE_BYTES: drop bytes up to its newline


@dataclass(slots=True)
class Tail:
    """Follows a run's files as they grow: appends, rotation, segments and processes that appear later.

    Files are tracked by inode, so a segment rotated away (``x.jsonl`` renamed ``x.jsonl.1``) is read
    on from where it was left before the new active file; a partial last line waits for its newline;
    a file truncated in place is read again from the start. Lines go through the same decoder and
    bad-line rule as whole-file reading. A directory that does not exist yet is waited for.
    """

    path: Path
    bad: BadLines = field(default_factory=BadLines)
    max_bytes_per_poll: int = 64 << 20
    _segments: dict[tuple[int, int], _Segment] = field(default_factory=dict)
    _skipped: set[str] = field(default_factory=set)

    @property
    def malformed_lines(self) -> int:
        """Lines skipped so far."""
        return self.bad.count

    def logs(self) -> Path | None:
        """The logs directory once it exists (``structured_logs/`` appears after the path itself)."""
        p = Path(self.path).expanduser()
        sub = p / schema.STRUCTURED_LOGS_DIR
        if sub.is_dir():
            return sub
        return p if p.is_dir() and any(schema.FILE_RE.match(n) for n in _names(p)) else None

    def poll(self) -> list[tuple[ProcessFiles, list[AnyRecord]]]:
        """The records appended since the last poll, per process (processes with none are left out)."""
        d = self.logs()
        if d is None:
            return []
        out = []
        seen: set[tuple[int, int]] = set()
        for pf in scan_process_files(d, self._warn_once):
            records: list[AnyRecord] = []
            for path in pf.paths:
                key = self._read(path, records)
                if key is not None:
                    seen.add(key)
            if records:
                out.append((pf, records))
        for gone in set(self._segments) - seen:  # deleted segments: forget them, inode numbers get reused
            del self._segments[gone]
        return out

    def _warn_once(self, message: str) -> None:
        if message not in self._skipped:  # polled every second: say it once
            self._skipped.add(message)
            self.bad.warn(message)

    def _read(self, path: Path, out: list[AnyRecord]) -> tuple[int, int] | None:
        try:
            with open_regular(path) as f:
                st = os.fstat(f.fileno())
                key = (st.st_dev, st.st_ino)
                seg = self._segments.get(key)
                if seg is None:
                    seg = self._segments[key] = _Segment()
                if st.st_size < seg.offset:  # truncated in place: start over
                    seg.offset, seg.lines, seg.partial, seg.skipping = 0, 0, b"", False
                if st.st_size == seg.offset:
                    return key
                f.seek(seg.offset)
                data = f.read(self.max_bytes_per_poll)
        except OSError:
            return None  # rotated away between listing and opening
        seg.offset += len(data)
        if seg.skipping:
            data = self._skip_long(seg, data)
        buf = seg.partial + data if seg.partial else data
        cut = buf.rfind(b"\n")
        if cut < 0:
            seg.partial = buf
            if len(buf) > MAX_LINE_BYTES:  # never held past the limit, however long it grows
                seg.partial, seg.skipping = b"", True
                self.bad.report(path, seg.lines + 1, f"line longer than {MAX_LINE_BYTES >> 20} MiB, not read")
            return key
        seg.partial = buf[cut + 1 :]
        whole = memoryview(buf)[: cut + 1]
        first = seg.lines + 1
        out.extend(decode_chunk(whole, path, lambda: first, self.bad))
        seg.lines += buf.count(b"\n", 0, cut + 1)
        return key


    @staticmethod
    def _skip_long(seg: _Segment, data: bytes) -> bytes:
        """What follows the end of a line being skipped (all of ``data`` is dropped until its newline)."""
        end = data.find(b"\n")
        if end < 0:
            return b""
        seg.skipping = False
        seg.lines += 1
        return data[end + 1 :]


def _names(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []
