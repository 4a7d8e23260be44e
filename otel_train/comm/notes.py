"""The hot path's part of recording an op: a :class:`Note` appended to a deque (docs/comm.md, "Recording").

A wrapper around a ``torch.distributed`` call makes one note before the call (so a rank that waits
inside it is known) and stamps its end after (a blocking call returned, or an async op's future
completed). Nothing here writes a record: the recorder's thread (``otel_train.comm.recorder``) turns
notes into ``comm.*`` spans. A note costs one object, one ``contextvars.copy_context()`` and one deque
append: no lock, no I/O, no device sync.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from threading import get_native_id
from typing import Any

from otel_train.record_clock import now_ns as time_ns  # the runtime's one clock (docs/clock.md)

MAX_QUEUED = 1 << 16
"""Notes the recorder has not taken yet; beyond, the oldest are dropped (a recorder that cannot keep up
must not grow the training process's memory without bound)."""

copy_context = contextvars.copy_context


class _ThreadId(threading.local):
    """This thread's native id, asked of the OS once per thread (``get_native_id`` is a system call)."""

    value: int | None = None


_thread_id = _ThreadId()


def native_tid() -> int:
    tid = _thread_id.value
    if tid is None:
        tid = _thread_id.value = get_native_id()
    return tid


class Note:
    """One op issued by this process: what, in which group, when; ``end_ns`` 0 while it runs."""

    __slots__ = ("op", "group", "seq", "fr_key", "peer", "nbytes", "dtype", "start_ns", "end_ns", "error",
                 "ctx", "tid", "work", "ids")

    def __init__(self, op: str, group: Any, seq: int, fr_key: int | None, peer: int | None, nbytes: int,
                 dtype: str | None) -> None:
        self.op = op
        self.group = group  # a GroupState (otel_train.comm.groups)
        self.seq = seq
        self.fr_key = fr_key  # the Flight Recorder entry this op makes (op_id or collective_seq_id), if known
        self.peer = peer
        self.nbytes = nbytes
        self.dtype = dtype
        self.ctx = copy_context()  # the issuing span (OTel context) and step: the span's parent and step
        tid = _thread_id.value
        self.tid = tid if tid is not None else native_tid()
        self.error: str | None = None
        self.end_ns = 0
        self.work: Any = None  # an async op's Work without a future: the recorder polls is_completed()
        self.ids: tuple[int | None, int] | None = None  # (trace id without a parent, span id) of its start record
        self.start_ns = time_ns()

    def done(self, fut: Any = None) -> None:
        """The op finished for this rank (a future's done-callback passes the future)."""
        if fut is not None:
            try:
                fut.value()
            except Exception as exc:  # noqa: BLE001 - a failed op (timeout, aborted group)
                self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        self.end_ns = time_ns()


class NoteQueue:
    """The deque between the hot path (``append``) and the recorder (``take``)."""

    __slots__ = ("_notes", "append")

    def __init__(self, maxlen: int = MAX_QUEUED) -> None:
        self._notes: deque[Note] = deque(maxlen=maxlen)
        self.append = self._notes.append  # one C call on the hot path

    def take(self) -> list[Note]:
        """Every note queued so far, oldest first (the recorder's thread). A full queue may have
        dropped its oldest notes: reported once and counted (never silently)."""
        if len(self._notes) == self._notes.maxlen:
            from otel_train import _report

            _report.report("comm.notes_dropped", "the comm recorder fell behind: the oldest op notes were dropped "
                           "(their comm.* spans are missing)")
        notes, pop = [], self._notes.popleft
        for _ in range(len(self._notes)):
            notes.append(pop())
        return notes

    def __len__(self) -> int:
        return len(self._notes)
