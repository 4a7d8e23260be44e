"""Flight Recorder dumps followed while a run is written (``watch --fr``, docs/comm.md): read again when
the dump file or folder changed, looked at every :data:`FR_POLL_S`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_train.analysis.comm import CommOp, Group
from otel_train.analysis.reading.fr_files import fingerprint

FR_POLL_S = 5.0
"""How often the Flight Recorder dump directory is looked at for new or changed dumps."""

ReadDumps = Callable[[Path], tuple[list[CommOp], list[Group]]]
"""Reads the dumps at a path: their comm ops and groups."""


class DumpPoller:
    """The dumps at ``path``, read by ``read`` when what is there changed."""

    def __init__(self, path: str | Path | None, read: ReadDumps | None) -> None:
        self._path = Path(path) if path is not None else None
        self._read = read
        self._seen: tuple[Any, ...] | None = None
        self._next = 0.0

    def poll(self, now: float) -> tuple[list[CommOp], list[Group]] | None:
        """The dumps' ops and groups when they changed since the last look, else None (also between
        looks, and without a path or a reader)."""
        if self._path is None or self._read is None or now < self._next:
            return None
        self._next = now + FR_POLL_S
        seen = fingerprint(self._path)  # a file or a folder, listed as the reader lists it (bounded)
        if seen == self._seen:
            return None
        self._seen = seen
        return self._read(self._path)
