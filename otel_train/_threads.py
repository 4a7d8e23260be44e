"""The runtime's own threads: one :class:`Worker` primitive, started so that it never takes the process's signals.

Python runs signal handlers only in the main thread, between bytecodes. The kernel hands a signal sent
to the process (``kill``, ``Pool.terminate``, a launcher's SIGTERM, a terminal's SIGINT) to any thread
that does not block it; when that is one of our background threads, CPython only marks the signal
tripped, and a main thread blocked in a C call (a lock, a semaphore, a ``recv``) is never woken to run
the handler. With the default action that would not matter (the kernel ends the process whichever
thread took the signal), but ``init`` installs a Python SIGTERM handler, so it does: a
process whose main thread waits in a lock or a semaphore could take a SIGTERM on our writer thread
and live on until something else woke it (a ``multiprocessing.Pool`` worker that had called ``init``
was found so, its pool's ``join`` waiting; workers now also keep SIGTERM's default action,
docs/runtime.md).

So every thread we start blocks SIGTERM and SIGINT for its whole life: it inherits the mask of the
thread that starts it, blocked only around ``Thread.start`` (no moment at its start takes a signal).
The process's signals then reach the main thread, or a thread of the user's. Standard library only.

Every thread the runtime keeps (the trace file's stall watch, the OTLP worker, the watchdog, the comm
recorder, the two SIGTERM threads) is a :class:`Worker`: a named daemon, one at a time, started as
above; asked to stop and waited for until a deadline, then drained on the caller's thread; and, in a fork
child, where it does not exist, forgotten.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

QUIET = frozenset({signal.SIGTERM, signal.SIGINT})
"""The signals our threads never take: the ones the runtime or Python handle in the main thread."""


def start_quiet(thread: threading.Thread) -> threading.Thread:
    """Start ``thread`` with :data:`QUIET` blocked in it (where the platform has ``pthread_sigmask``)."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        thread.start()
        return thread
    old = mask(signal.SIG_BLOCK, QUIET)
    try:
        thread.start()
    finally:
        mask(signal.SIG_SETMASK, old)
    return thread


def held_here(lock: Any) -> bool:
    """Whether the calling thread holds ``lock`` (an ``RLock``; False for a lock that cannot say). A
    SIGTERM handler asks, before it wakes the shutdown thread (``otel_train.sigterm``)."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if is_owned is not None else False


class Worker:
    """One of the runtime's threads: a daemon named ``name`` that runs ``loop`` (no arguments).

    - :meth:`start` starts it unless this worker holds one already (a loop that ends by itself and may be
      started again calls :meth:`done` as it leaves), with :data:`QUIET` blocked (``quiet=False``: the starting
      thread's mask, for a thread that runs third-party code as the SDK's own worker would);
    - :meth:`stop` sets :attr:`stopping`, waits at most ``timeout_s`` for the thread (never for itself),
      then runs ``drain`` with the same ``timeout_s`` on the caller's thread: what the loop left;
    - the loop waits with :meth:`sleep` (on :attr:`stopping`) or :meth:`pause` (relative sleeps);
    - :meth:`forget`, in a fork child, where the thread does not exist: none held, a fresh stop flag.
    """

    def __init__(self, name: str, loop: Callable[[], None], *, quiet: bool = True,
                 drain: Callable[[float], None] | None = None) -> None:
        self.name = name
        self._loop = loop
        self._quiet = quiet
        self._drain = drain
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start the thread unless one is held; whether this call started one."""
        if self.thread is not None:
            return False
        self.thread = thread = threading.Thread(target=self._loop, name=self.name, daemon=True)  # before a done()
        try:
            if self._quiet:
                start_quiet(thread)
            else:
                thread.start()
        except BaseException:
            self.thread = None
            raise
        return True

    def done(self) -> None:
        """From the loop, as it ends by itself: the next :meth:`start` starts a new thread. An owner that may
        call :meth:`start` meanwhile calls both under one lock of its own (the file check ticker)."""
        self.thread = None

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until asked to stop; whether asked to stop."""
        return self.stopping.wait(seconds)

    def pause(self, seconds: float, slice_s: float) -> bool:
        """Wait ``seconds`` in relative sleeps of at most ``slice_s``; whether asked to stop (seen within a
        slice). Not ``Event.wait``: a timed wait on an absolute deadline never returns in a process whose
        clocks libfaketime offsets (tests/test_clock_torchrun.py)."""
        end = time.monotonic() + seconds
        while not self.stopping.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(slice_s, left))
        return True

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the thread to end (not when called from it); whether none runs."""
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout_s))
        return thread is None or not thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Ask the loop to stop, wait for it at most ``timeout_s``, then drain; whether the thread ended."""
        self.stopping.set()
        ended = self.join(timeout_s)
        if self._drain is not None:
            self._drain(timeout_s)
        return ended

    def forget(self) -> None:
        """In a fork child: the thread is not in this process."""
        self.thread = None
        self.stopping = threading.Event()
