"""Crash-safe, size-rotating, append-only line writer for one rank's trace file, and the watch that finds a
write that does not return.

:class:`RotatingFileWriter` is the file, written in the caller's thread: every record goes to the kernel
whole within a single ``os.write``, and nothing is buffered in Python, so when the call that emitted a
record returns its ``write(2)`` has returned (a SIGKILL right after loses nothing; a C call that holds
the GIL cannot keep it from the file: docs/runtime.md, "The write guarantee"). Write failures (full
disk, I/O error, a descriptor closed underneath, a deleted directory) never reach the caller: they are
counted, reported once per errno (``otel_train._report``), and the writer keeps trying on later records.

A file deleted underneath (a cleanup job removing the run directory) would swallow every later
record into an unlinked inode. So about once a second, and before every rotation, the writer checks
the open file's link count: a deleted file is reported once, what was written to it (and to rotated
segments gone with it) is counted as lost, and a new file is made at the same path (its directory
too, one level, when the directory's parent still exists: a whole deleted run is not resurrected).
Shutdown checks once more (:meth:`check_now`), so a deletion less than a second before it is found too.

One daemon thread per process (:class:`_Ticker`) costs the hot path nothing: every ``TICK_S`` it looks
at each open writer's call in progress (``_busy``: the line being written, one store before and one
after each call). The same call seen in progress for ``STALL_S`` is a *stall*: a FUSE mount or an NFS
server that stopped answering, a FIFO nobody reads. The ticker reports it once on stderr and marks the
writer ``stalled``, so the JSONL processor stops waiting for the thread stuck in it: records other
threads make meanwhile are dropped and counted, never queued. The stuck thread itself waits for the
storage, in the kernel: crash safety wins that trade (docs/runtime.md, "A trace file that stops
answering"). When the storage answers, the next record announces the stall (``on_notice``). Once a
second the ticker also lowers each writer's limit, so its next write takes the slow path, which checks
the file.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from typing import Any, Callable

from otel_train import _modes, _report
from otel_train._threads import Worker

__all__ = ["RotatingFileWriter", "STALL_S", "TICK_S"]

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
"""``O_NOFOLLOW``: a link planted at the path (a file re-made after a deletion) is refused (ELOOP, reported
like any failed write), never appended to."""
CHECK_INTERVAL_S = 1.0
"""How often a writer that is writing checks that its file is still linked."""
TICK_S = 0.1
"""How often the ticker looks for a call in progress."""
STALL_S = 0.5
"""A call into the OS (a write, an open, a rename) seen in progress this long is a stall: reported, and
nobody else waits for the writer until it returns. Detected ``STALL_S`` to ``STALL_S + TICK_S`` after the
call began (docs/runtime.md)."""
_CLOSED = "closed"
_LOST = "lost"
_RESUMED = "resumed"


class _Ticker:
    """One daemon thread per process: every ``TICK_S`` it looks for a stalled call in each open writer
    (:meth:`RotatingFileWriter._look`), and every ``CHECK_INTERVAL_S`` it sets each writer's limit to -1,
    so that writer's next write takes the slow path, which checks the file. It ends when no writer is
    left and starts again with the next one."""

    def __init__(self) -> None:
        self._writers: weakref.WeakSet[RotatingFileWriter] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._worker = Worker("otel_train.file_check", self._run)

    def add(self, writer: RotatingFileWriter) -> None:
        with self._lock:
            self._writers.add(writer)
            self._worker.start()  # unless it runs

    def remove(self, writer: RotatingFileWriter) -> None:
        with self._lock:
            self._writers.discard(writer)

    def _run(self) -> None:
        ticks_per_check = max(1, round(CHECK_INTERVAL_S / TICK_S))
        tick = 0
        while True:
            time.sleep(TICK_S)
            tick += 1
            with self._lock:
                writers = list(self._writers)
                if not writers:
                    self._worker.done()
                    return
            now = time.monotonic()
            for writer in writers:
                try:
                    writer._look(now)
                except Exception as exc:  # noqa: BLE001 - the ticker keeps ticking
                    _report.report_exception("the trace file's stall watch", exc)
                if tick % ticks_per_check == 0:
                    writer._limit = -1  # one int store: atomic under the GIL; the writer recomputes it


_ticker = _Ticker()


def _new_ticker_in_child() -> None:
    # A fork child has none of its parent's threads, and the lock may have been held at fork time.
    global _ticker
    _ticker = _Ticker()


os.register_at_fork(after_in_child=_new_ticker_in_child)


class RotatingFileWriter:
    """Appends complete lines to ``path``, rotating to ``path.1`` … ``path.<backup_count>``.

    Rotation happens before a write when the active file is non-empty and the line would push it
    past ``max_bytes``; with ``backup_count == 0`` the active file is truncated instead. A line
    longer than ``max_bytes`` is still written whole, alone in its file.

    Not thread-safe by design: one thread calls it at a time (the JSONL processor's lock). The ticker
    reads ``_busy`` and sets ``_limit`` and the stall state from its own thread (single stores).
    """

    __slots__ = ("_path", "_max_bytes", "_backup_count", "_fsync", "_file_mode", "_shifts", "_segments",
                 "_segment_lines", "_fd", "_size", "_lines", "_torn", "_limit", "_pending_loss", "on_loss",
                 "dropped_records", "lost_records", "lost_bytes", "__weakref__", "_closed", "_errors",
                 "_dropped_bytes", "_no_file", "_busy", "_seen", "_seen_at", "stalled_since", "stalls",
                 "on_notice")

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
        self._segment_lines = [0] * backup_count  # records in path.1 … path.N, for counting losses
        # The highest segment that may exist: a rotation renames only those (one rename each, not one per
        # backup_count: 1000 backups made every rotation 1000 system calls, a loaded writer thread seconds).
        self._segments = _highest_segment(self._path, backup_count)
        self._fd = -1
        self._size = 0
        self._lines = 0  # records written to the open file
        self._torn = False
        self._closed = False
        self._errors = 0
        self._dropped_bytes = 0
        self._limit = -1  # past it, write() takes the slow path (_prepare); -1: no open file or a check is due
        self._pending_loss: tuple[int, int] | None = None
        self.on_loss: Callable[[int, int, str], None] | None = None
        """Called after the first record that reached a new file made because the old one was deleted:
        (records lost, bytes lost, reason). It may call ``write`` again."""
        self.dropped_records = 0
        """Records that did not reach the file whole: failed writes, and lost with a deleted file."""
        self.lost_records = 0
        self.lost_bytes = 0
        self._busy: Any = None  # the call in progress (its line, or a rename's name); None between calls
        self._seen: Any = None  # the ticker's: the call it saw in progress, and since when
        self._seen_at = 0.0
        self.stalled_since = 0.0
        """Monotonic time the call in progress began, once the ticker judged it stalled; 0.0 otherwise."""
        self.stalls = 0
        self.on_notice: Callable[[dict[str, Any]], None] | None = None
        """Called after the first record written once a reported stall ended: ``{"reason", "stalled_ms"}``
        (the JSONL processor adds what it dropped meanwhile). It may call ``write`` again."""
        self._open()  # OSError here is the caller's to turn into a configuration error
        self._no_file: OSError = OSError(errno.EBADF, os.strerror(errno.EBADF))  # why there is no file open
        _ticker.add(self)

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

    @property
    def stalled(self) -> bool:
        """Whether a call into the OS has been in progress for ``STALL_S`` and has not returned."""
        return bool(self.stalled_since)

    def position(self) -> tuple[int, int] | None:
        """(inode, size) of the active file, or None while there is none (closed, or failed and not reopened).

        A reader finds where a digest was taken by the inode: rotation renames the file, keeping it.
        """
        if self._fd < 0:
            return None
        try:
            return os.fstat(self._fd).st_ino, self._size
        except OSError:
            return None

    def write(self, line: bytes) -> bool:
        """Append one ``\\n``-terminated record; True when it reached the kernel whole. Never raises."""
        n = len(line)
        self._busy = line  # the ticker sees a call in progress (docs/runtime.md, "A trace file that stops answering")
        try:
            # One comparison on the hot path: past the limit lie rotation, the deleted-file check,
            # reopening after a failure, ending a torn line, the end of a stall and the closed state.
            if self._size + n > self._limit:
                ready = self._prepare(n)
                if ready is not True:
                    return self._unprepared(ready, line)
            written = os.write(self._fd, line)
            if written != n:
                written = self._finish_short_write(line, written)
            self._size += written
            self._lines += 1
        except OSError as exc:
            self._fail(exc, n)
            return False
        finally:
            self._busy = None
        if self._fsync:
            return self._sync()
        return True

    def check_now(self) -> tuple[int, int] | None:
        """Check now that the open file is still linked (shutdown calls it: the once-a-second check may
        not have come since a deletion), making a new one if not, or if there
        is none after a failure. Returns the (records, bytes) lost and not yet announced once a new file
        is open to announce them in, and forgets them: the caller announces them (while no file could be
        made, they stay for the next write that makes one, which calls ``on_loss``). Never raises."""
        if not self._closed:
            try:
                if self._fd >= 0:
                    self._check_linked()
                else:
                    self._reopen()  # after a failure: the loss of a deleted file is known once a new one is made
            except OSError as exc:
                if self._fd >= 0:
                    self._fail(exc, 0)  # the check itself failed
                else:  # no file could be made: the next write tries again (or fails so), and counts it
                    self._no_file = exc
        if self._fd < 0:
            return None
        pending, self._pending_loss = self._pending_loss, None
        return pending

    def close(self) -> None:
        """Close the file; idempotent. Later writes return False."""
        self._closed = True
        self._discard_fd()
        _ticker.remove(self)

    def _prepare(self, n: int) -> bool | str:
        """Make the file ready for an ``n``-byte line; True, or why not (``_CLOSED``, ``_LOST``)."""
        if self._fd < 0:
            if self._closed:
                return _CLOSED
            self._reopen()
        else:
            self._check_linked()  # the ticker's once a second, or a rotation is due
        if self._torn:
            # A fragment from an earlier short write (or an earlier process) has no newline: end it,
            # so this record starts on a line of its own.
            self._size += os.write(self._fd, b"\n")
            self._torn = False
        if self._size and self._size + n > self._max_bytes:
            self._rotate()
        self._limit = self._max_bytes
        if self._pending_loss is not None:
            return _LOST
        return _RESUMED if self.stalled_since else True  # past every call that can block: the storage answers

    def _unprepared(self, why: bool | str, line: bytes) -> bool:
        if why is _CLOSED:
            self._dropped_bytes += len(line)
            return False
        if why is _RESUMED:
            return self._resumed(line)
        # A new file replaced a deleted one: write the line, then say what was lost (after it, so
        # that a notice record the callback writes follows this line's seq).
        (lines, size), self._pending_loss = self._pending_loss, None  # type: ignore[misc]
        ok = self.write(line)
        if self.on_loss is not None:
            try:
                self.on_loss(lines, size, "trace file deleted")
            except Exception as exc:  # noqa: BLE001 - the callback's fault must not become ours
                _report.report_exception("announcing a deleted trace file", exc)
        since, self.stalled_since = self.stalled_since, 0.0
        if since:  # the new file's open was the call that stalled (a FIFO nobody opened)
            self._end_stall(since)
        return ok

    def _resumed(self, line: bytes) -> bool:
        # The first record since a reported stall: write it, then say how long the stall was (after it,
        # so that the notice record the callback writes follows this line's seq).
        since, self.stalled_since = self.stalled_since, 0.0
        ok = self.write(line)
        self._end_stall(since)
        return ok

    def _end_stall(self, since: float) -> None:
        stalled_s = max(0.0, time.monotonic() - since)
        _report.report(f"write resumed {self._path}",
                       f"writing {self._path} resumed after {stalled_s:.1f} s (records dropped meanwhile are counted "
                       "in process_end.dropped_records)")
        if self.on_notice is not None:
            try:
                self.on_notice({"reason": "trace file write stalled", "stalled_ms": round(stalled_s * 1e3, 1)})
            except Exception as exc:  # noqa: BLE001 - the callback's fault must not become ours
                _report.report_exception("announcing a trace file stall", exc)

    def _look(self, now: float) -> None:
        """The ticker's look (its own thread): the same call in progress since ``STALL_S`` ago is a stall."""
        busy = self._busy
        if busy is None or busy is not self._seen:
            self._seen, self._seen_at = busy, now
            return
        if self.stalled_since or now - self._seen_at < STALL_S:
            return
        self.stalled_since = self._seen_at
        self.stalls += 1
        self._limit = -1  # the next write (the storage answered) takes the slow path, which announces it
        _report.report(f"write stalled {self._path}",
                       f"writing {self._path} has stalled: a call into the OS has not returned for "
                       f"{now - self._seen_at:.1f} s; the thread making it waits for the storage, records other "
                       "threads make meanwhile are dropped and counted (docs/runtime.md)")

    def _open(self) -> None:
        fd = os.open(self._path, _OPEN_FLAGS, self._file_mode)
        try:
            _modes.tighten_fd(fd)  # 0644 at most whatever the umask (otel_train._modes)
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._size = size
        self._lines = 0
        self._torn = size > 0 and not self._ends_with_newline(size)
        self._limit = -1 if self._torn else self._max_bytes

    def _reopen(self) -> None:
        directory = os.path.dirname(self._path) or "."
        if not os.path.isdir(directory) and os.path.isdir(os.path.dirname(directory) or "."):
            _modes.make_dirs(directory)
        self._open()

    def _check_linked(self) -> None:
        """If the open file was deleted, count what it held as lost and start a new one."""
        if os.fstat(self._fd).st_nlink:
            return
        lines, size = self._lines, self._size
        for i, (_, segment) in enumerate(reversed(self._shifts)):
            if self._segment_lines[i] and not os.path.exists(segment):  # rotated segments gone too
                lines += self._segment_lines[i]
                self._segment_lines[i] = 0
        self._discard_fd()
        self.lost_records += lines
        self.lost_bytes += size
        self.dropped_records += lines
        pending = self._pending_loss or (0, 0)
        self._pending_loss = (pending[0] + lines, pending[1] + size)
        _report.report(f"file deleted {self._path}",
                       f"{self._path} was deleted (or its directory) while in use: {lines} record(s) written to "
                       "it and to rotated segments gone with it are lost; writing goes on in a new file at the "
                       "same path")
        self._reopen()

    def _ends_with_newline(self, size: int) -> bool:
        # The write descriptor is write-only; peek at the last byte through a short-lived reader to
        # learn whether an earlier process left a torn line we must not glue our first record onto.
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
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
            os.ftruncate(self._fd, 0)
            self._size = 0
            self._lines = 0
            self._torn = False
        else:
            self._segment_lines = [self._lines, *self._segment_lines[:-1]]
            self._discard_fd()
            self._segments = min(self._segments + 1, self._backup_count)
            for src, dst in self._shifts[len(self._shifts) - self._segments:]:
                try:
                    os.replace(src, dst)
                except FileNotFoundError:
                    pass  # a segment not written yet, or the active file removed underneath
                self._busy = dst  # one call per segment, each a new one for the ticker: a long rotation is no stall
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
                self._limit = -1  # the next write ends the fragment first (_prepare)
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
        self._limit = -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # Linux frees the descriptor even when close reports an error

    def _fail(self, exc: OSError, dropped: int) -> None:
        self._errors += 1
        self._dropped_bytes += dropped
        if dropped:
            self.dropped_records += 1
        if exc.errno == errno.EBADF:
            # The number is no longer ours (closed or replaced underneath): never close it, reopen.
            self._fd = self._limit = -1
        elif exc.errno == errno.ESTALE:
            self._discard_fd()
        if self._fd < 0:
            self._no_file = exc
        name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "unknown"
        _report.report(f"write {self._path}:{name}",
                       f"cannot write {self._path}: {exc.strerror or exc} (errno {name}); "
                       "tracing continues, records are being dropped")


def _highest_segment(path: str, backup_count: int) -> int:
    """The highest N <= ``backup_count`` for which ``path.N`` exists (an earlier writer's segments); 0 if none."""
    folder, base = os.path.split(path)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return backup_count  # unknown: every rotation renames all, as before
    found = [int(suffix) for name in names if name.startswith(base + ".")
             and (suffix := name[len(base) + 1:]).isdigit()]
    return min(max(found, default=0), backup_count)
