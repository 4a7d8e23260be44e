"""Crash-safe, size-rotating, append-only line writer for one rank's trace file, and the queue in front of it
that keeps a stalled file from stopping training.

:class:`RotatingFileWriter` is the file: every record goes to the kernel whole within a single
``os.write`` (``write_many``: a run of records in one) and nothing is buffered in Python, so a process
killed right after ``write`` returns has lost nothing. Write
failures (full disk, I/O error, a descriptor closed underneath, a deleted directory) never reach the
caller: they are counted, reported once per errno (``otel_train._report``), and the writer keeps trying
on later records.

A file deleted underneath (a cleanup job removing the run directory) would swallow every later
record into an unlinked inode. So about once a second, and before every rotation, the writer checks
the open file's link count: a deleted file is reported once, what was written to it (and to rotated
segments gone with it) is counted as lost, and a new file is made at the same path (its directory
too, one level, when the directory's parent still exists: a whole deleted run is not resurrected).
Shutdown checks once more (:meth:`check_now`), so a deletion less than a second before it is found too.
The once-a-second cadence costs the hot path nothing: one daemon thread per process (``_Ticker``)
lowers each open writer's limit, so the next write takes the slow path, which checks.

:class:`QueuedWriter` is what the runtime writes through (docs/runtime.md, "A trace file that stops
answering"). A ``write(2)`` to a FUSE mount that stopped answering, or to an NFS server that is gone,
blocks for as long as the storage does, in the kernel, where no signal but SIGKILL reaches it; so no
training thread ever makes one. The hot path hands each complete line to one writer thread (a queue
put), which makes the ``os.write`` calls above, one per batch. A healthy writer keeps up within
milliseconds (the GIL's switch interval at worst); at most ``SYNC_BYTES`` are handed over between two
*sync points* (the first record, once a second, before a rotation), where the caller waits for the
writer to catch up and check the file, at most ``STALL_S``. A writer that has not caught up by then is
stalled: nobody waits for it any more, lines are queued up to ``QUEUE_MAX_BYTES`` and dropped past it,
counted. A stall that lasts ``STALL_REPORT_S`` or costs a record is reported on stderr, and once the
writer has caught up one more line and a notice record say how long it stalled and what was dropped.
From the report on, the queue's end advances at most half as fast as the writer writes, so a writer
that answers again catches up (after at most ``2 × QUEUE_MAX_BYTES``) even behind a producer faster
than it: the stall ends and is announced, and what did not fit is dropped, counted.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from collections import deque
from queue import Empty, SimpleQueue
from typing import Any, Callable

from otel_train import _modes, _report
from otel_train._threads import start_quiet

__all__ = ["QueuedWriter", "RotatingFileWriter"]

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
"""``O_NOFOLLOW``: a link planted at the path (a file re-made after a deletion) is refused (ELOOP, reported
like any failed write), never appended to."""
CHECK_INTERVAL_S = 1.0
"""How often a writer that is writing checks that its file is still linked."""
STALL_S = 0.1
"""A caller waits at most this long for the writer thread (at a sync point); past it the writer is stalled."""
SYNC_BYTES = 1 << 20
"""At most this much is handed to a healthy writer thread between two sync points: what a SIGKILL can lose."""
QUEUE_MAX_BYTES = 8 << 20
"""At most this much waits in memory for a stalled writer; later lines are dropped and counted."""
BATCH_LINES = 1024
BATCH_BYTES = 256 << 10
"""The writer thread writes what is queued in one call of at most this many lines and bytes."""
STALL_REPORT_S = 1.0
"""A stall is reported once it has lasted this long (or cost a record); ``close`` gives up on a write that
has not returned for this long."""
CLOSE_TIMEOUT_S = 3.0
"""``close`` (and a counter read) waits at most this long for a writer that is still making progress."""
_POLL_S = 0.005
_CLOSED = "closed"
_LOST = "lost"


class _Ticker:
    """One daemon thread per process: every ``CHECK_INTERVAL_S`` it sets each open writer's limit to -1,
    so that writer's next write takes the slow path, which checks the file. It ends when no writer is
    left and starts again with the next one."""

    def __init__(self) -> None:
        self._writers: weakref.WeakSet[RotatingFileWriter] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, writer: RotatingFileWriter) -> None:
        with self._lock:
            self._writers.add(writer)
            if self._thread is None:
                self._thread = start_quiet(threading.Thread(target=self._run, name="otel_train.file_check", daemon=True))

    def remove(self, writer: RotatingFileWriter) -> None:
        with self._lock:
            self._writers.discard(writer)

    def _run(self) -> None:
        while True:
            time.sleep(CHECK_INTERVAL_S)
            with self._lock:
                writers = list(self._writers)
                if not writers:
                    self._thread = None
                    return
            for writer in writers:
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

    Not thread-safe by design: one thread calls it at a time (a :class:`QueuedWriter`'s writer thread,
    or a caller's own lock). A QueuedWriter takes over the once-a-second check and the making of a new
    file (:meth:`check_now`, at its sync points): then a write that finds no file open fails (counted,
    as the failure that left none) instead of making one, so a new file is only ever begun in order with
    the records around it.
    """

    __slots__ = (
        "_path",
        "_max_bytes",
        "_backup_count",
        "_fsync",
        "_file_mode",
        "_shifts",
        "_segments",
        "_segment_lines",
        "_fd",
        "_size",
        "_lines",
        "_torn",
        "_limit",
        "_pending_loss",
        "on_loss",
        "dropped_records",
        "lost_records",
        "lost_bytes",
        "__weakref__",
        "_closed",
        "_errors",
        "_dropped_bytes",
        "_reopen_on_write",
        "_no_file",
        "progress_at",
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
        self._open()  # OSError here is the caller's to turn into a configuration error
        self._reopen_on_write = True  # False under a QueuedWriter: only check_now makes a new file
        self.progress_at = 0.0
        """Monotonic time of the last call into the OS during :meth:`write_many` or a rotation (a caller
        watching for a stall tells a long batch from a call that does not return)."""
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

    def position(self, timeout_s: float | None = None) -> tuple[int, int] | None:
        """(inode, size) of the active file, or None while there is none (closed, or failed and not reopened).
        ``timeout_s`` is QueuedWriter's: this writer writes in the caller's thread, so nothing is waited for.

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
        try:
            # One comparison on the hot path: past the limit lie rotation, the deleted-file check,
            # reopening after a failure, ending a torn line, and the closed state (see _prepare).
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
        if self._fsync:
            return self._sync()
        return True

    def write_many(self, lines: list[bytes]) -> None:
        """Append several records, each as :meth:`write` would, in as few ``os.write`` calls as rotation
        allows: the lines that fit before the limit go in one call (each line whole within it). A failed or
        short call falls back to one line at a time from the first line it did not finish, so every
        failure is counted per record as :meth:`write` counts it. Never raises."""
        i, count = 0, len(lines)
        while i < count:
            self.progress_at = time.monotonic()
            room, j, size = self._limit - self._size, i, 0
            while j < count and size + len(lines[j]) <= room:
                size += len(lines[j])
                j += 1
            if j - i < 2:  # one line, or the next one needs the slow path: the one-line write does it all
                self.write(lines[i])
                i += 1
                continue
            try:
                written = os.write(self._fd, b"".join(lines[i:j]))
            except OSError:
                written = 0  # each line again on its own: its failure is reported and counted there
            if written == size:
                self._size += size
                self._lines += j - i
                if self._fsync:
                    self._sync()
                i = j
                continue
            i = self._after_short_batch(lines, i, j, written)

    def _after_short_batch(self, lines: list[bytes], i: int, j: int, written: int) -> int:
        # The whole lines the call wrote count as written; the line it cut is finished as a one-line
        # write finishes a short write (torn if that fails); returns the first line still to write.
        while i < j and written >= len(lines[i]):
            written -= len(lines[i])
            self._size += len(lines[i])
            self._lines += 1
            i += 1
        if i < j:
            line = lines[i]
            if not written:  # the call failed: this line again on its own, which reports and counts
                self.write(line)
                return i + 1
            try:
                self._size += self._finish_short_write(line, written)
                self._lines += 1
            except OSError as exc:
                self._fail(exc, len(line))
            i += 1
        return i

    def check_now(self) -> tuple[int, int] | None:
        """Check now that the open file is still linked (shutdown and a QueuedWriter's sync points call it:
        the once-a-second check may not have come since a deletion), making a new one if not, or if there
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
            if not self._reopen_on_write:  # a QueuedWriter makes the new file at its next sync point
                raise OSError(self._no_file.errno, self._no_file.strerror)
            self._reopen()
        else:
            self._check_linked(self._reopen_on_write)  # the ticker's once a second, or a rotation is due
        if self._torn:
            # A fragment from an earlier short write (or an earlier process) has no newline: end it,
            # so this record starts on a line of its own.
            self._size += os.write(self._fd, b"\n")
            self._torn = False
        if self._size and self._size + n > self._max_bytes:
            self._rotate()
        self._limit = self._max_bytes
        return _LOST if self._pending_loss is not None else True

    def _unprepared(self, why: bool | str, line: bytes) -> bool:
        if why is _CLOSED:
            self._dropped_bytes += len(line)
            return False
        # A new file replaced a deleted one: write the line, then say what was lost (after it, so
        # that a notice record the callback writes follows this line's seq).
        (lines, size), self._pending_loss = self._pending_loss, None  # type: ignore[misc]
        ok = self.write(line)
        if self.on_loss is not None:
            try:
                self.on_loss(lines, size, "trace file deleted")
            except Exception as exc:  # noqa: BLE001 - the callback's fault must not become ours
                _report.report_exception("announcing a deleted trace file", exc)
        return ok

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

    def _check_linked(self, reopen: bool = True) -> None:
        """If the open file was deleted, count what it held as lost and start a new one (or, without
        ``reopen``, raise ENOENT: the caller makes it later)."""
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
        if not reopen:
            self._no_file = OSError(errno.ENOENT, os.strerror(errno.ENOENT))
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
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
                self.progress_at = time.monotonic()  # one call per segment: a long rotation is not a stall
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


class _Command:
    """Work for the writer thread, done in its turn between lines: ``result = fn(file)``, then ``done``
    (and ``lock``, held until then, released: a waiter wakes at once)."""

    __slots__ = ("fn", "result", "done", "last", "lock")

    def __init__(self, fn: Callable[[RotatingFileWriter], Any], last: bool = False) -> None:
        self.fn = fn
        self.result: Any = None
        self.done = False
        self.last = last  # the thread ends after it (close)
        self.lock = threading.Lock()
        self.lock.acquire()


def _nothing(file: RotatingFileWriter) -> None:
    return None


def _close_file(file: RotatingFileWriter) -> None:
    file.close()


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


class QueuedWriter:
    """A :class:`RotatingFileWriter` written by a thread of its own, so no caller ever waits on a stalled file.

    ``write`` hands a complete line over (one queue put on the fast path) and returns True, or False when
    the line is dropped (the writer stalled and the queue full, or closed). Lines are written in the order
    they were handed over, each whole within one ``os.write``. The caller serializes ``write`` (the JSONL
    processor's lock); the callbacks ``on_loss(records, bytes, reason)`` (the file was found deleted) and
    ``on_notice(attrs)`` (a reported stall ended) are called from inside ``write``/``check_now`` on the
    caller's thread, after the line, and may call ``write`` again. Never raises.

    A *sync point* (the first line, once a second when the ticker lowers ``_limit``, before a rotation,
    after ``SYNC_BYTES``, every record while no file can be made): the caller queues a file check, then
    the line, and waits until the writer has written it, at most ``STALL_S``; a deleted file's notice
    follows the first line of the new one (when the writer missed the wait, ``missed_syncs``, the first
    line handed over once it caught up), and the line is in the kernel when ``write`` returns.
    A writer that did not get there in time is *stalled*: nobody waits for it until it has caught up.
    A stall is reported (stderr, and a notice record when it ends) once it has lasted ``STALL_REPORT_S`` or
    cost a record; a shorter one (a writer thread kept from the GIL by busy threads) passes silently.
    The counters (``errors``, ``dropped_records`` …) first wait for what was handed over, as ``flush``.
    """

    __slots__ = (
        "_file", "_queue", "_put", "_thread", "_pos", "_done", "_limit", "_busy_since", "_current",
        "_stalled_since", "_stall_reported", "_stall_dropped", "_stall_dropped_bytes", "_dropped",
        "_dropped_bytes_own", "_losses", "_notices", "_closed", "_forked", "_missed", "_deadline", "_reported_done",
        "on_loss",
        "on_notice", "__weakref__",
    )

    def __init__(self, file: RotatingFileWriter) -> None:
        self._file = file
        file.on_loss = self._file_lost  # a loss the writer thread found on its own (not at a sync point)
        file._reopen_on_write = False  # a new file is made only at a sync point (check_now), in order
        _ticker.remove(file)  # the file's periodic check becomes ours, made at a sync point
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._put = self._queue.put
        self._pos = 0  # bytes handed over (caller's side)
        self._done = 0  # bytes written or failed (writer thread's side)
        self._limit = -1  # past it, write() takes the slow path; -1: a sync point is due
        self._busy_since = 0.0  # monotonic start of what the writer thread is doing now; 0.0 when idle
        self._current: list[bytes] | None = None  # the batch being written
        self._stalled_since = 0.0  # when what the writer has not finished began; 0.0 while healthy
        self._stall_reported = False
        self._stall_dropped = self._stall_dropped_bytes = 0  # in this stall
        self._reported_done = 0  # _done when this stall was reported (_queue_or_drop's budget)
        self._dropped = self._dropped_bytes_own = 0  # in all: stalls, abandoned at close; bytes also after close
        self._losses: deque[tuple[int, int]] = deque()  # deleted-file losses, not yet announced
        self._notices: deque[dict[str, Any]] = deque()  # ended stalls, not yet announced
        self._closed = self._forked = False
        self._missed = 0  # sync points whose wait ended before the writer got there
        self._deadline = 0.0  # monotonic; no wait goes past it (shutdown's bound); 0.0: none
        self.on_loss: Callable[[int, int, str], None] | None = None
        self.on_notice: Callable[[dict[str, Any]], None] | None = None
        self._thread = start_quiet(threading.Thread(target=self._run, name="otel_train.writer", daemon=True))
        _queued.add(self)
        _ticker.add(self)

    # The caller's side.

    def write(self, line: bytes) -> bool:
        """Hand one ``\\n``-terminated record to the writer thread; False when it is dropped. Never raises."""
        pos = self._pos + len(line)
        if pos > self._limit:  # one comparison on the hot path: sync points, stalls and close lie past it
            return self._write_slow(line)
        self._pos = pos
        self._put(line)
        return True

    @property
    def path(self) -> str:
        """The active file's path."""
        return self._file.path

    @property
    def file(self) -> RotatingFileWriter:
        """The file the writer thread writes (its counters lag what was handed over: read them here)."""
        return self._file

    @property
    def missed_syncs(self) -> int:
        """Sync points the writer thread did not reach within their wait: a stalled file, or on a loaded
        machine a writer thread kept from the GIL for 0.1 s (what it then held back is written later, in order)."""
        return self._missed

    @property
    def stalled(self) -> bool:
        """Whether the writer thread is stalled (it did not catch up in time, and has not since)."""
        return bool(self._stalled_since)

    @property
    def errors(self) -> int:
        """Failed writes (and failed rotations, reopens, fsyncs) of what was handed over so far."""
        return self._settled().errors

    @property
    def dropped_records(self) -> int:
        """Records that did not reach the file whole: failed, lost with a deleted file, dropped while
        stalled, or still queued when the writer was closed."""
        return self._settled().dropped_records + self._dropped

    @property
    def dropped_bytes(self) -> int:
        """Bytes of records that did not reach the file whole (as ``dropped_records``, and written after close)."""
        return self._settled().dropped_bytes + self._dropped_bytes_own

    @property
    def lost_records(self) -> int:
        return self._settled().lost_records

    @property
    def lost_bytes(self) -> int:
        return self._settled().lost_bytes

    def finish_by(self, deadline: float) -> None:
        """From now on no wait here (a sync point, ``flush``, a counter, ``position``, ``close``) lasts past
        ``deadline`` (``time.monotonic()``): shutdown's bound. Each wait alone is bounded, but shutdown reads
        several counters and a writer that is slow yet making progress (a loaded machine, a slow disk)
        would take the whole wait each time. What is not written by then counts as dropped, at ``close``."""
        self._deadline = deadline

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until the writer thread has done everything handed over so far: True. False at once when
        closed or in a reported stall; else after ``timeout_s``, or once one write has not returned for
        ``STALL_REPORT_S``."""
        if self._closed or self._stall_reported and not self._caught_up():
            return False
        return self._sync(_Command(_nothing), timeout_s, STALL_REPORT_S)

    def position(self, timeout_s: float | None = None) -> tuple[int, int] | None:
        """(inode, size) of the active file once everything handed over so far is written, or None (no file,
        stalled, closed, or not written within ``timeout_s``, by default ``STALL_S``). The writer thread takes
        it in its turn; the caller waits as at a sync point (shutdown's final digest waits longer: up to
        1 MB may be queued)."""
        if self._closed or self._stalled_since:
            return None
        wait = STALL_S if timeout_s is None else timeout_s
        command = _Command(RotatingFileWriter.position)
        return command.result if self._sync(command, wait, max(STALL_S, min(wait, STALL_REPORT_S))) else None

    def check_now(self) -> tuple[int, int] | None:
        """A sync point without a line (shutdown calls it): check the file, waiting as ``flush`` does;
        announce an ended stall (``on_notice``). Returns the (records, bytes) lost with a deleted file and
        not yet announced, and forgets them: the caller announces them. Never raises."""
        if not self._closed:
            if self._stalled_since and self._caught_up():
                self._end_stall()
            if not self._stall_reported:
                self._sync(_Command(self._check_file), CLOSE_TIMEOUT_S, STALL_REPORT_S)
        lost = None
        while self._losses:
            records, size = self._losses.popleft()
            lost = (records + lost[0], size + lost[1]) if lost else (records, size)
        self._announce(losses=False)
        return lost

    def close(self) -> None:
        """Write what is queued (waiting as ``flush``), close the file, end the thread; idempotent. What a
        writer stuck in a write still holds is counted as dropped and reported once; later writes return False."""
        if self._closed:
            return
        self._closed = True
        self._limit = -1
        _ticker.remove(self)
        if self._forked:
            return
        stop = _Command(_close_file, last=True)
        self._put(stop)
        if not self._wait(stop, CLOSE_TIMEOUT_S, STALL_REPORT_S):
            self._abandon()

    def _write_slow(self, line: bytes) -> bool:
        if self._closed:
            self._dropped_bytes_own += len(line)  # like RotatingFileWriter: bytes counted, not records
            return False
        if self._stalled_since:
            if not self._caught_up():
                return self._queue_or_drop(line)
            self._end_stall()
        # The file is checked first, then the line goes into whatever file is open then; the caller waits
        # until the writer has written it (so a sync point's record is in the kernel when write returns).
        self._put(_Command(self._check_file))
        self._pos += len(line)
        self._put(line)
        if not self._sync(_Command(_nothing), STALL_S, STALL_S):
            return True  # queued: the writer is stalled, and the hot path no longer waits for it
        file = self._file
        if file._fd < 0:
            self._limit = self._pos  # no file could be made: every record tries again, at a sync point
        else:
            backlog = self._pos - self._done
            to_rotation = file._max_bytes - file._size - backlog  # the next sync point comes before a rotation
            self._limit = self._pos + max(0, min(SYNC_BYTES - backlog, to_rotation))
        self._announce()
        return True

    def _sync(self, command: _Command, timeout_s: float, stuck_s: float) -> bool:
        """Queue ``command`` and wait for it (``_wait``); a writer that does not get to it is stalled."""
        started = time.monotonic()
        self._put(command)
        if self._wait(command, timeout_s, stuck_s):
            return True
        self._missed += 1
        if not self._closed and not self._forked and not self._stalled_since:
            self._stalled_since = self._stuck_since() or started
            self._limit = -1  # every write takes the slow path until the writer has caught up
        return False

    def _wait(self, command: _Command, timeout_s: float, stuck_s: float) -> bool:
        """Wait until the writer thread has done ``command``: True. False after ``timeout_s``, as soon as one
        batch or command has been in progress for ``stuck_s``, or when the thread is gone (a fork child)."""
        start = time.monotonic()
        if self._deadline:
            timeout_s = min(timeout_s, self._deadline - start)
        while not command.done:
            now = time.monotonic()
            busy = self._stuck_since()
            if now - start >= timeout_s or (busy and now - busy >= stuck_s) or not self._thread.is_alive():
                return command.done
            if command.lock.acquire(timeout=min(_POLL_S, max(1e-6, start + timeout_s - now))):
                return True
        return True

    def _stuck_since(self) -> float:
        """Since when the writer thread has been in one call without coming back (0.0: idle): the start of
        its batch or command, or its last call into the OS within it."""
        busy = self._busy_since
        return max(busy, self._file.progress_at) if busy else 0.0

    def _caught_up(self) -> bool:
        """Whether the writer thread has done every line handed over and is idle."""
        return self._done == self._pos and not self._busy_since

    def _queue_or_drop(self, line: bytes) -> bool:
        # Stalled: nobody waits. The line waits in memory while there is room, else it is dropped, counted.
        # Once the stall is reported the room grows by half of what the writer writes, not all of it: the
        # backlog shrinks whatever the caller makes, so a writer that answers again catches up and the
        # stall ends (a producer faster than the storage kept the queue full, and the stall open, forever).
        n = len(line)
        if not self._stall_reported and time.monotonic() - self._stalled_since >= STALL_REPORT_S:
            self._report_stall()
        done = (self._done + self._reported_done) >> 1 if self._stall_reported else self._done
        if self._pos - done + n <= QUEUE_MAX_BYTES:
            self._pos += n
            self._put(line)
            return True
        if not self._stall_reported:
            self._report_stall()
        self._stall_dropped += 1
        self._stall_dropped_bytes += n
        self._dropped += 1
        self._dropped_bytes_own += n
        return False

    def _report_stall(self) -> None:
        self._stall_reported = True
        self._reported_done = self._done
        stalled_s = time.monotonic() - self._stalled_since
        _report.report(f"write stalled {self.path}",
                       f"writing {self.path} has stalled: a write or a check of the file has not returned for "
                       f"{stalled_s:.1f} s; training goes on, records wait in memory ({QUEUE_MAX_BYTES >> 20} MiB "
                       "at most), later ones are dropped and counted until it returns")

    def _end_stall(self) -> None:
        stalled_s = max(0.0, time.monotonic() - self._stalled_since)
        records, size, reported = self._stall_dropped, self._stall_dropped_bytes, self._stall_reported
        self._stalled_since = 0.0
        self._stall_reported = False
        self._stall_dropped = self._stall_dropped_bytes = 0
        if not reported:
            return  # a short hold-up (the writer thread kept from the GIL by busy threads): nothing lost
        _report.report(f"write resumed {self.path}",
                       f"writing {self.path} resumed after {stalled_s:.1f} s; {records} record(s) ({size} bytes) "
                       "were dropped meanwhile (counted in process_end.dropped_records)")
        self._notices.append({"reason": "trace file write stalled", "stalled_ms": round(stalled_s * 1e3, 1),
                              "dropped_records": records, "dropped_bytes": size})

    def _announce(self, losses: bool = True) -> None:
        # After the line that found them, on the caller's thread: the notices get the next seqs.
        while losses and self._losses:
            records, size = self._losses.popleft()
            self._call(self.on_loss, records, size, "trace file deleted")
        while self._notices:
            self._call(self.on_notice, self._notices.popleft())

    def _call(self, callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001 - the callback's fault must not become ours
            _report.report_exception("announcing a trace file loss", exc)

    def _settled(self) -> RotatingFileWriter:
        self.flush()
        return self._file

    def _abandon(self) -> None:
        # The writer is stuck in a write that may never return: what it still holds is not written.
        records = size = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except Empty:
                break
            if item.__class__ is bytes:
                records += 1
                size += len(item)
        for line in self._current or ():  # the batch in progress: some of it may have reached the storage
            records += 1
            size += len(line)
        self._dropped += records
        self._dropped_bytes_own += size
        self._put(_Command(_close_file, last=True))  # should the write ever return: close the file, end the thread
        busy = self._stuck_since()
        why = (f"a write has not returned for {time.monotonic() - busy:.1f} s" if busy else
               f"the writer did not catch up within {CLOSE_TIMEOUT_S:g} s")
        _report.report(f"write abandoned {self.path}",
                       f"{records} record(s) ({size} bytes) still waiting for {self.path} at close are not written: "
                       f"{why} (counted in process_end.dropped_records)")

    def _forked_in_child(self) -> None:
        # A fork child has no writer thread: nothing it writes through this object would ever be written.
        self._forked = self._closed = True
        self._limit = -1

    # The writer thread's side.

    def _check_file(self, file: RotatingFileWriter) -> None:
        lost = file.check_now()
        if lost:
            self._losses.append(lost)

    def _file_lost(self, records: int, size: int, reason: str) -> None:
        self._losses.append((records, size))

    def _run(self) -> None:
        # Everything queued goes in one batch (BATCH_LINES, BATCH_BYTES at most; a command ends it): one
        # os.write per batch. A thread that released the GIL for every line would get it back only every
        # switch interval (5 ms) while a training thread runs Python, and fall behind.
        get, file, clock = self._queue.get, self._file, time.monotonic
        while True:
            item = get()
            batch: list[bytes] = []
            size = 0
            while item.__class__ is bytes:
                batch.append(item)
                size += len(item)
                item = None
                if len(batch) >= BATCH_LINES or size >= BATCH_BYTES:
                    break
                try:
                    item = get(False)
                except Empty:
                    break
            if batch:
                self._current = batch
                self._busy_since = clock()
                try:
                    file.write_many(batch)  # never raises by contract; the guard keeps the thread alive regardless
                except Exception as exc:  # noqa: BLE001
                    _report.report_exception("the trace file writer", exc)
                self._done += size
                if file._fd < 0:
                    self._limit = -1  # the file failed: the next record makes a new one at a sync point
                self._current = None
                self._busy_since = 0.0
            if item is not None and self._command(item, file, clock):
                return

    def _command(self, command: _Command, file: RotatingFileWriter, clock: Callable[[], float]) -> bool:
        """Do ``command``; True when it was the last."""
        self._busy_since = clock()
        try:
            command.result = command.fn(file)
        except Exception as exc:  # noqa: BLE001
            _report.report_exception("the trace file writer", exc)
        command.done = True
        command.lock.release()
        self._busy_since = 0.0
        return command.last


_queued: weakref.WeakSet[QueuedWriter] = weakref.WeakSet()


def _queued_writers_in_child() -> None:
    for writer in list(_queued):
        writer._forked_in_child()


os.register_at_fork(after_in_child=_queued_writers_in_child)
