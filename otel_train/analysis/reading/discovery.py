"""Where a run's trace files are: discovery, grouping by process, and opening without blocking.

A run directory holds ``structured_logs/<source>.global_rank_<rank>.<stamp>-<rand>.jsonl[.N]``; one
``<stamp>-<rand>`` instance is one process. Segments are read oldest first (``.N`` … ``.1``, then
the active file). Only regular files are opened, non-blocking, so a FIFO or a directory named like
a trace file is skipped with a warning instead of hanging the reader.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from otel_train import schema

Warn = Callable[[str], None]


class TraceReadError(Exception):
    """A path that holds no readable trace files; the message is one line (what, where, how to fix)."""


def warn_to_stderr(message: str) -> None:
    """The default warning sink: one line on stderr."""
    print(message, file=sys.stderr)


def _quiet(message: str) -> None:
    return None


def one_line(text: str) -> str:
    """``text`` on one line of at most 200 characters (for a warning)."""
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


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


def names(d: Path) -> list[str]:
    """The entries of ``d`` by name; [] when it cannot be listed."""
    try:
        return os.listdir(d)
    except OSError:
        return []
