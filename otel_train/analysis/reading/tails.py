"""Growing files: :class:`Tail` follows a run as it is written (``watch``, ``push --follow``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from otel_train import schema
from otel_train.analysis.reading.discovery import ProcessFiles, names, open_regular, scan_process_files
from otel_train.analysis.reading.lines import MAX_LINE_BYTES, BadLines, decode_chunk
from otel_train.analysis.reading.types import AnyRecord

@dataclass(slots=True)
class _Segment:
    offset: int = 0
    lines: int = 0  # complete lines consumed, for warnings
    partial: bytes = b""
    skipping: bool = False  # inside a line past MAX_LINE_BYTES: drop bytes up to its newline
    missed: int = 0  # polls in a row that did not find it


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
        return p if p.is_dir() and any(schema.FILE_RE.match(n) for n in names(p)) else None

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
        # Deleted segments are forgotten (inode numbers get reused), but only once two polls in a row
        # missed them: a rotation between listing and opening hides a live segment from one poll (``x``
        # listed, renamed ``x.1`` before it is opened), and forgetting it then read it again from 0.
        for key in set(self._segments) - seen:
            seg = self._segments[key]
            seg.missed += 1
            if seg.missed >= 2:
                del self._segments[key]
        for key in seen:
            self._segments[key].missed = 0
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
