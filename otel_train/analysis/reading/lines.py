"""The one bad-line rule (:class:`BadLines`) and the one decoder of buffers of whole lines.

A line that is not a schema-v1 record (torn, garbage, binary, too deeply nested, or a field of the
wrong type or out of range: docs/schema.md) is skipped, counted, and reported once per file as
``file:line``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.analysis.reading import titan
from otel_train.analysis.reading.discovery import Warn, one_line, warn_to_stderr
from otel_train.analysis.reading.types import DECODE_ERRORS, RECORD_DECODER, AnyRecord

CHUNK_BYTES = 1 << 20
MAX_LINE_BYTES = 8 << 20
"""Longest line a reader decodes (the runtime's largest records, stall stacks, are well under 1 MiB).
A longer line is skipped as it is read, never held, and counted as malformed (docs/schema.md)."""


class BadLines:
    """The one rule for lines that are not records: skip, count, and warn once per file (``file:line``)."""

    def __init__(self, warn: Warn | None = None, *, collect: bool = False) -> None:
        self.count = 0
        self.warnings: list[Any] = []  # collected: strings, or _BadLineWarning until absorbed
        # collect=True keeps the warnings for a later absorb() (a read that may be thrown away).
        self.warn = self.warnings.append if collect else (warn or warn_to_stderr)
        self._collect = collect
        self._warned: set[Path] = set()
        self.streams: dict[Path, titan.Stream] = {}  # torchtitan/pimm files: their pairing state, per file

    def stream(self, path: Path) -> titan.Stream:
        """The pairing state of one of torchtitan's or pimm's files, kept across its chunks (file order)."""
        got = self.streams.get(path)
        if got is None:
            got = self.streams[path] = titan.Stream(path)
        return got

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
        return (f"warning: {self.path}:{where}: skipped malformed line ({one_line(self.reason)}); "
                "further bad lines in this file are only counted")


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
    if titan.is_titan(chunk):  # torchtitan's or pimm's file: the second decoder, same records out
        return titan.decode(chunk, path, bad.stream(path),
                            lambda i, why: bad.report(path, lambda: first_line() + i, why))
    try:
        return RECORD_DECODER.decode_lines(chunk)
    except DECODE_ERRORS:
        pass
    # Something in this chunk is bad: decode line by line to lose only the bad lines.
    items: list[AnyRecord] = []
    for index, line in enumerate(bytes(chunk).split(b"\n")):
        if not line.strip():
            continue
        try:
            items.append(RECORD_DECODER.decode(line))
        except DECODE_ERRORS as exc:
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
