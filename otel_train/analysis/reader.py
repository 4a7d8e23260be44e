"""Find a run's trace files and stream their records, skipping bad lines.

A run directory holds ``structured_logs/<source>.global_rank_<rank>.<stamp>-<rand>.jsonl[.N]``; one
``<stamp>-<rand>`` instance is one process. Segments are read oldest first (``.N`` … ``.1``, then the
active file). Lines are decoded in chunks with msgspec; a chunk that fails falls back to line-by-line
decoding so that one torn, garbage or binary line costs only itself: it is counted and the first one
of each file is reported as ``file:line``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from otel_train import schema

_CHUNK_BYTES = 1 << 20

T = TypeVar("T")


class TraceReadError(Exception):
    """A path that holds no readable trace files; the message is one line (what, where, how to fix)."""


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


def logs_dir(path: str | Path) -> Path:
    """The ``structured_logs`` directory for a run dir or the logs dir itself; raises TraceReadError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise TraceReadError(f"{p}: no such directory; pass a run directory or its {schema.STRUCTURED_LOGS_DIR}/")
    if not p.is_dir():
        raise TraceReadError(f"{p}: not a directory; pass a run directory or its {schema.STRUCTURED_LOGS_DIR}/")
    sub = p / schema.STRUCTURED_LOGS_DIR
    return sub if sub.is_dir() else p


def find_process_files(path: str | Path) -> list[ProcessFiles]:
    """Group a run's trace files by process, sorted by (rank, source, instance); raises TraceReadError."""
    d = logs_dir(path)
    try:
        names = [e.name for e in d.iterdir()]
    except OSError as exc:
        raise TraceReadError(f"{d}: cannot list directory ({exc.strerror or exc})") from None
    groups: dict[tuple[str, int, str], list[tuple[int, Path]]] = {}
    for name in names:
        m = schema.FILE_RE.match(name)
        if m is None:
            continue
        key = (m["source"], int(m["rank"]), f"{m['stamp']}-{m['rand']}")
        segment = int(m["segment"]) if m["segment"] is not None else 0
        groups.setdefault(key, []).append((segment, d / name))
    if not groups:
        raise TraceReadError(
            f"{d}: no trace files (expected <source>.global_rank_<N>.<YYYYmmdd-HHMMSS>-<rand>.jsonl); "
            "was tracing enabled with this save_path?"
        )
    out = [
        ProcessFiles(source, rank, instance, tuple(p for _, p in sorted(segs, key=lambda s: -s[0])))
        for (source, rank, instance), segs in groups.items()
    ]
    out.sort(key=lambda pf: (pf.rank, pf.source, pf.instance))
    return out


class _Head(msgspec.Struct):
    attempt: int | None = None


def assign_attempts(pfs: Iterable[ProcessFiles]) -> dict[ProcessFiles, int]:
    """Map each process to its restart attempt.

    The ``attempt`` field of a process's first readable record wins. When it is missing, or two
    instances of the same (source, rank) claim the same attempt (restarts the launcher did not
    number), instances are numbered by start time instead.
    """
    by_key: dict[tuple[str, int], list[tuple[int | None, ProcessFiles]]] = {}
    for pf in pfs:
        by_key.setdefault((pf.source, pf.rank), []).append((_peek_attempt(pf), pf))
    out: dict[ProcessFiles, int] = {}
    for items in by_key.values():
        items.sort(key=lambda it: it[1].instance)
        claimed = [a for a, _ in items]
        if None in claimed or len(set(claimed)) != len(claimed):
            out.update({pf: i for i, (_, pf) in enumerate(items)})
        else:
            out.update({pf: a for a, pf in items})  # type: ignore[misc]
    return out


def _peek_attempt(pf: ProcessFiles) -> int | None:
    decoder = msgspec.json.Decoder(_Head)
    for path in pf.paths:
        try:
            with path.open("rb") as f:
                for i, line in enumerate(f):
                    if i >= 32:
                        break
                    try:
                        return decoder.decode(line).attempt
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
        except OSError:
            continue
    return None


def warn_to_stderr(message: str) -> None:
    """The default warning sink: one line on stderr."""
    print(message, file=sys.stderr)


def is_record(obj: Any) -> bool:
    """Whether a decoded JSON value is a schema-v1 record (an object with ``v``, a numeric ``ts``, a ``kind``)."""
    return (
        type(obj) is dict
        and schema.V in obj
        and isinstance(obj.get(schema.TS), (int, float))
        and isinstance(obj.get(schema.KIND), str)
    )


class Reader:
    """Streams records; skips malformed/truncated/binary lines, counting them, warning once per file.

    ``progress``, when given, is called with the number of bytes consumed after each chunk.
    """

    def __init__(
        self,
        *,
        warn: Callable[[str], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.malformed_lines = 0
        self._warn = warn or warn_to_stderr
        self._progress = progress

    def absorb(self, malformed: int, warnings: Iterable[str], nbytes: int) -> None:
        """Account for what another Reader (in a worker process) read: counts, warnings, progress."""
        self.malformed_lines += malformed
        for line in warnings:
            self._warn(line)
        if self._progress is not None:
            self._progress(nbytes)

    def records(self, pf: ProcessFiles) -> Iterator[dict]:
        """Every valid record of the process as a dict, in file order (unknown fields kept)."""
        return chain.from_iterable(self._batches(pf, msgspec.json.Decoder(), is_record))

    def typed(self, pf: ProcessFiles, type_: type[T]) -> Iterator[T]:
        """Records decoded straight into ``type_`` (a msgspec.Struct; unknown fields ignored).

        A line that does not match ``type_`` (e.g. misses a required field) counts as malformed.
        """
        return chain.from_iterable(self.typed_batches(pf, type_))

    def typed_batches(self, pf: ProcessFiles, type_: type[T]) -> Iterator[list[T]]:
        """Like ``typed`` in lists of about a MiB of input each: the fastest way through a big file."""
        return self._batches(pf, msgspec.json.Decoder(type_), None)

    def _batches(
        self, pf: ProcessFiles, decoder: msgspec.json.Decoder, valid: Callable[[Any], bool] | None
    ) -> Iterator[list[Any]]:
        for path in pf.paths:
            bad_in_file = 0
            for offset, chunk in _chunks(path, self._warn):
                try:
                    items = decoder.decode_lines(chunk)
                    if valid is not None and not all(map(valid, items)):
                        items = None
                except (msgspec.DecodeError, msgspec.ValidationError):
                    items = None
                if items is None:
                    # Something in this chunk is bad: decode line by line to lose only the bad lines.
                    items = []
                    first_line = _line_number(path, offset)
                    for index, line in enumerate(bytes(chunk).split(b"\n")):
                        if not line.strip():
                            continue
                        try:
                            item = decoder.decode(line)
                        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                            item, reason = None, str(exc)
                        else:
                            reason = "not a schema-v1 record (needs v, ts, kind)"
                        if item is not None and (valid is None or valid(item)):
                            items.append(item)
                            continue
                        self.malformed_lines += 1
                        bad_in_file += 1
                        if bad_in_file == 1:
                            self._warn(
                                f"warning: {path}:{first_line + index}: skipped malformed line ({reason}); "
                                "further bad lines in this file are only counted"
                            )
                yield items
                if self._progress is not None:
                    self._progress(len(chunk))


def _chunks(path: Path, warn: Callable[[str], None]) -> Iterator[tuple[int, bytes | memoryview]]:
    """``(byte offset, buffer)`` pieces of a file, each ending at a line break (but the torn tail).

    A line cut by a block boundary is yielded alone (the tail of the previous block joined to the
    head of this one), so the bulk of every block goes out as a view, never copied.
    """
    try:
        f = path.open("rb")
    except OSError as exc:
        # A segment rotated away between listing and reading: its records are gone, say so and go on.
        warn(f"warning: {path}: cannot read ({exc.strerror or exc}); skipped")
        return
    with f:
        offset = 0
        tail = b""
        while True:
            block = f.read(_CHUNK_BYTES)
            if not block:
                break
            cut = block.rfind(b"\n")
            if cut < 0:
                tail += block
                continue
            start = 0
            if tail:
                start = block.find(b"\n") + 1
                joined = tail + block[:start]
                yield offset, joined
                offset += len(joined)
            if start <= cut:
                yield offset, memoryview(block)[start : cut + 1]
                offset += cut + 1 - start
            tail = block[cut + 1 :]
        if tail:
            yield offset, tail


def _line_number(path: Path, offset: int) -> int:
    """1-based number of the line starting at ``offset`` (only needed for a warning, so rarely)."""
    count = 1
    try:
        with path.open("rb") as f:
            while offset > 0:
                block = f.read(min(offset, _CHUNK_BYTES))
                if not block:
                    break
                count += block.count(b"\n")
                offset -= len(block)
    except OSError:
        pass
    return count
