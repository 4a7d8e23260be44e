"""Starting the runtime's own threads so that they never take the process's signals.

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
"""

from __future__ import annotations

import signal
import threading
from typing import Any

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
