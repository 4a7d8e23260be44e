"""A process's digest (docs/schema.md, "Digests") and the raw scan for spans that ended after it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import msgspec

from otel_train import schema, sketch
from otel_train.analysis.reading.discovery import ProcessFiles, Warn, one_line, open_regular
from otel_train.analysis.reading.lines import CHUNK_BYTES, MAX_LINE_BYTES
from otel_train.analysis.reading.types import (
    DECODE_ERRORS, MAX_DUR_MS, MAX_ID, Id, SpanStart, Step, Ts,
)

class DigestFile(msgspec.Struct, gc=False):
    """Where a digest was taken: the trace file's inode and its size then."""

    ino: Annotated[int, msgspec.Meta(ge=0)]
    size: Annotated[int, msgspec.Meta(ge=0)]


class DigestSpan(msgspec.Struct, gc=False):
    """A span open when a digest was taken."""

    span_id: str
    name: str
    start_ts: Ts
    parent_span_id: str | None = None
    trace_id: str | None = None
    step: Step | None = None
    tid: Id | None = None

    def start_record(self) -> SpanStart:
        """The span's start as the record the span model pairs."""
        return SpanStart(v=1, ts=self.start_ts, name=self.name, span_id=self.span_id,
                         parent_span_id=self.parent_span_id, trace_id=self.trace_id, step=self.step, tid=self.tid)


_Bucket = Annotated[int, msgspec.Meta(ge=0, lt=sketch.BUCKETS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
_TotalMs = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DUR_MS * MAX_DUR_MS)]


class DigestPhase(msgspec.Struct, gc=False):
    """One span name's closed durations in a digest: count, total and longest ms, and sketch buckets.

    Every field is range-checked like a record's: a bucket index past the sketch's last bucket (whose
    value no float holds), a negative or unbounded total, is a digest that is not ours, skipped whole."""

    count: _Count
    sum_ms: _TotalMs
    max_ms: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DUR_MS)]
    buckets: dict[_Bucket, _Count]


class Digest(msgspec.Struct, gc=False):
    """A process's digest (docs/schema.md, "Digests")."""

    v: int
    ts: Ts
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
    except DECODE_ERRORS as exc:
        warn(f"warning: {path}: not a digest ({one_line(str(exc))}); phases of this process skipped")
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
        while block := f.read(CHUNK_BYTES):
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
