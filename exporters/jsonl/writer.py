"""Crash-safe, size-rotating, append-only line writer for one rank's trace file.

Every record goes to the kernel in a single ``os.write`` and nothing is buffered in Python, so a
process killed right after ``write`` returns has lost nothing. Write failures (full disk, I/O error,
a descriptor closed underneath, a deleted directory) never reach the training code: they are
counted, reported once per errno (``otel_train._report``), and the writer keeps trying on later records.

Not thread-safe by design: the JSONL span processor serializes calls under its own lock.
"""

from __future__ import annotations

import errno
import os

from otel_train import _report

__all__ = ["RotatingFileWriter"]

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


class RotatingFileWriter:
    """Appends complete lines to ``path``, rotating to ``path.1`` … ``path.<backup_count>``.

    Rotation happens before a write when the active file is non-empty and the line would push it
    past ``max_bytes``; with ``backup_count == 0`` the active file is truncated instead. A line
    longer than ``max_bytes`` is still written whole, alone in its file.
    """

    __slots__ = (
        "_path",
        "_max_bytes",
        "_backup_count",
        "_fsync",
        "_file_mode",
        "_shifts",
        "_fd",
        "_size",
        "_torn",
        "_closed",
        "_errors",
        "_dropped_bytes",
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int,
        backup_count: int,
        fsync: bool = False,
        file_mode: int = 0o644,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"RotatingFileWriter: max_bytes must be >= 1, got {max_bytes}")
        if backup_count < 0:
            raise ValueError(f"RotatingFileWriter: backup_count must be >= 0, got {backup_count}")
        self._path = os.fspath(path)
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._fsync = fsync
        self._file_mode = file_mode
        # Oldest first, so each rename frees the name the next one moves into.
        names = [self._path] + [f"{self._path}.{i}" for i in range(1, backup_count + 1)]
        self._shifts = [(names[i - 1], names[i]) for i in range(backup_count, 0, -1)]
        self._fd = -1
        self._size = 0
        self._torn = False
        self._closed = False
        self._errors = 0
        self._dropped_bytes = 0
        self._open()  # OSError here is the caller's to turn into a configuration error

    @property
    def path(self) -> str:
        """The active file's path."""
        return self._path

    @property
    def errors(self) -> int:
        """Failed writes (and failed rotations, reopens, fsyncs)."""
        return self._errors

    @property
    def dropped_bytes(self) -> int:
        """Bytes of records that did not reach the file whole."""
        return self._dropped_bytes

    def write(self, line: bytes) -> bool:
        """Append one ``\\n``-terminated record; True when it reached the kernel whole. Never raises."""
        n = len(line)
        try:
            if self._fd < 0:
                if self._closed:
                    self._dropped_bytes += n
                    return False
                self._open()
            if self._size and self._size + n > self._max_bytes:
                self._rotate()
            # A torn fragment from an earlier short write has no newline: end it so this record
            # starts on a line of its own.
            data = b"\n" + line if self._torn else line
            written = os.write(self._fd, data)
            if written != len(data):
                written = self._finish_short_write(data, written)
            self._size += written
            self._torn = False
        except OSError as exc:
            self._fail(exc, n)
            return False
        if self._fsync:
            return self._sync()
        return True

    def close(self) -> None:
        """Close the file; idempotent. Later writes return False."""
        self._closed = True
        self._discard_fd()

    def _open(self) -> None:
        fd = os.open(self._path, _OPEN_FLAGS, self._file_mode)
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._size = size
        self._torn = size > 0 and not self._ends_with_newline(size)

    def _ends_with_newline(self, size: int) -> bool:
        # The write descriptor is write-only; peek at the last byte through a short-lived reader to
        # learn whether an earlier process left a torn line we must not glue our first record onto.
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return True
        try:
            return os.pread(fd, 1, size - 1) == b"\n"
        except OSError:
            return True
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        if not self._backup_count:
            # An unlinked file (directory removed underneath) would swallow records forever.
            if os.fstat(self._fd).st_nlink == 0:
                self._discard_fd()
                self._open()
            else:
                os.ftruncate(self._fd, 0)
                self._size = 0
                self._torn = False
        else:
            self._discard_fd()
            for src, dst in self._shifts:
                try:
                    os.replace(src, dst)
                except FileNotFoundError:
                    pass  # a segment not written yet, or the active file removed underneath
            self._open()

    def _finish_short_write(self, data: bytes, written: int) -> int:
        # Retrying either completes the line (the short write was transient) or raises the real
        # errno (ENOSPC, EIO) for the report; either way the line is never silently torn.
        view = memoryview(data)
        try:
            while written < len(data):
                chunk = os.write(self._fd, view[written:])
                if chunk == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += chunk
        except OSError:
            if written:
                self._size += written
                self._torn = True
            raise
        return written

    def _sync(self) -> bool:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._fail(exc, 0)  # the bytes reached the page cache; they may still be lost
            return False
        return True

    def _discard_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # Linux frees the descriptor even when close reports an error

    def _fail(self, exc: OSError, dropped: int) -> None:
        self._errors += 1
        self._dropped_bytes += dropped
        if exc.errno == errno.EBADF:
            # The number is no longer ours (closed or replaced underneath): never close it, reopen.
            self._fd = -1
        elif exc.errno == errno.ESTALE:
            self._discard_fd()
        name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "unknown"
        _report.report(f"write {self._path}:{name}",
                       f"cannot write {self._path}: {exc.strerror or exc} (errno {name}); "
                       "tracing continues, records are being dropped")
