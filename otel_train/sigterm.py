"""SIGTERM: the trace ends (``process_end`` with ``signal``), then the process dies of it or the handler
that was there before ``init`` runs, as without otel-train (docs/runtime.md, "Processes, signals and forks").

The shutdown never runs on the thread the signal interrupted. That thread may hold a lock the shutdown
needs (a span's attribute lock, an ``Event``'s, a stream's: none of them reentrant), and a shutdown run
in the handler then waited for it for ever (the fault suite's kill trials under load hung about twice
in a thousand). Instead a :class:`ShutdownThread`, started at ``init`` with SIGTERM blocked, waits on a
pipe; a handler writes a byte into it (a write takes no lock) and the thread shuts down.

- On the main thread (:class:`MainThreadHandler`, a Python handler) the handler then waits, in
  ``select``, for the thread to finish. As a rule it has within milliseconds, and the handler takes the
  previous action: the interrupted code never ran again, as when the handler shut down itself. When the
  thread has not finished within the handler's wait (it waits for a lock the interrupted code holds),
  the handler returns, that code goes on and lets go of the lock, and the thread, once done, sends
  SIGTERM to the main thread again until the handler has taken the previous action.
- A main thread inside a C call that does not return (a collective waiting for a peer that is gone)
  runs no Python handler at all: CPython's C handler only marks it due. Without otel-train the process
  would have died of SIGTERM at once, so a :class:`StuckMainWatch` stands in. ``faulthandler``'s C
  handler, chained in front of CPython's, writes the stack of the thread the signal landed on into the
  watch's pipe; the Python handler empties that pipe whenever it runs. Bytes left there
  :data:`STUCK_AFTER_S` later mean no handler ran: the watch asks the shutdown thread for the round the
  handler would have asked for, waits for it as the handler would, and where the previous action is
  the default it dies of SIGTERM itself. A previous Python handler stays due, and runs once the main
  thread comes back.
- Off the main thread no Python handler can be installed: ``faulthandler``'s C handler writes into the
  pipe instead (``otel_train.runtime.signals.watch_off_main``), and the thread itself then dies of SIGTERM.

One thread per process, for its life; a fork child closes its copy of the pipes (:meth:`ShutdownThread.close`).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any, Callable

from otel_train import _report
from otel_train._threads import Worker

RETRY_S = 0.005
"""How often a SIGTERM is sent to the main thread again until its handler has run."""
MAX_RESENDS = 600
"""At most this many times (3 s)."""
STUCK_AFTER_S = 0.5
"""A SIGTERM that no Python handler has taken this long after it came finds the main thread inside a C
call (:class:`StuckMainWatch`). A main thread that runs Python takes it within milliseconds; one wrongly
judged stuck (a long C call that does return) costs nothing, since the watch and the handler share the
round, and with the default action the process was to die of the signal at once anyway."""
MAX_DEFERRALS = 200
"""A SIGTERM that lands in the middle of a record is taken again ``RETRY_S`` later, this many times at
most (about a second; a record is never that long now: a hung mount holds the writer thread, not the
caller, docs/runtime.md, "A trace file that stops answering")."""

_SHUT_DOWN = b"s"  # a byte in the pipe: shut down
_RESEND = b"r"  # or: send SIGTERM to the main thread again until its handler has run (a deferral)


class ShutdownThread:
    """Runs ``shutdown`` on a thread of its own when woken through a pipe, then ``after`` on that thread.

    :meth:`wake` may be called from a signal handler (one ``write``, no lock); ``raw`` means every byte
    in the pipe asks for a shutdown (``faulthandler`` writes a traceback into it). ``rounds_done`` counts
    the shutdowns finished; a byte in ``done_r`` follows each one, for a handler waiting in ``select``.
    """

    def __init__(self, shutdown: Callable[[], None], after: Callable[[], None], *, raw: bool = False) -> None:
        self.wake_r, self.wake_w = os.pipe()
        self.done_r, self.done_w = os.pipe()
        for fd in (self.wake_w, self.done_r, self.done_w):
            os.set_blocking(fd, False)  # a signal handler must never block on a full pipe
        self._shutdown, self._after, self._raw = shutdown, after, raw
        self.rounds_done = 0
        self.resend_until: Callable[[], bool] | None = None  # set before a _RESEND byte is written
        self.closed = False

    def start(self) -> None:
        # Started with SIGTERM blocked (a quiet Worker): the signal never lands on the thread that answers it.
        Worker("otel_train.sigterm", self._run).start()

    def wake(self, what: bytes = _SHUT_DOWN) -> None:
        try:
            os.write(self.wake_w, what)
        except OSError:  # full (a wake is already waiting there) or closed (a fork child): nothing to add
            pass

    def wait_done(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for a shutdown to finish (no lock taken: a handler calls it)."""
        try:
            ready, _, _ = select.select([self.done_r], [], [], max(0.0, timeout_s))
            if ready:
                os.read(self.done_r, 4096)
        except (OSError, ValueError):  # closed: nothing to wait for
            time.sleep(max(0.0, timeout_s))

    def close(self) -> None:
        """In a fork child, where the thread does not exist: the descriptors go."""
        self.closed = True
        _close_all(self.wake_r, self.wake_w, self.done_r, self.done_w)

    def _run(self) -> None:
        while True:
            try:
                got = os.read(self.wake_r, 1 << 16)
            except OSError:
                return
            if not got or self.closed:
                return
            if not self._raw and _RESEND in got and self.resend_until is not None:
                resend(self.resend_until)
            if self._raw or _SHUT_DOWN in got:
                self._round()

    def _round(self) -> None:
        try:
            self._shutdown()
        except Exception as exc:  # noqa: BLE001 - this thread must go on to the previous action
            _report.report_exception("shutdown on SIGTERM", exc)
        self.rounds_done += 1
        try:
            os.write(self.done_w, b"d")
        except OSError:
            pass
        self._after()


def resend(handled: Callable[[], bool]) -> None:
    """Send SIGTERM to the main thread every ``RETRY_S`` until ``handled()``, ``MAX_RESENDS`` times at most.

    Once is not enough. CPython runs a Python handler only when the main thread reaches a bytecode or a
    blocking call returns EINTR; a signal that lands just before the main thread blocks (between its last
    check and the futex of a semaphore) marks the handler due and wakes nothing, so it waits for the next
    signal. Sent to the main thread, never to the process: a thread that took it would wake nothing either
    (``otel_train/_threads.py``)."""
    main = threading.main_thread().ident
    for _ in range(MAX_RESENDS):
        time.sleep(RETRY_S)
        if handled() or main is None:
            return
        try:
            signal.pthread_kill(main, signal.SIGTERM)
        except (OSError, ValueError):  # the main thread is gone: the process is ending
            return


class MainThreadHandler:
    """The Python SIGTERM handler ``init`` installs on the main thread, chaining ``previous``.

    ``mid_record()`` says whether the interrupted thread is inside a record: the signal is then taken
    again a moment later (:data:`MAX_DEFERRALS`), so the record is whole before anything comes after it.
    ``wait_s`` bounds the handler's wait for the shutdown thread (longer than any shutdown that needs
    nothing of the interrupted code). A handler may run nested in itself (a second SIGTERM ends the
    ``select`` of the first), so the waits are counted, and a round's previous action is taken once.
    """

    def __init__(self, previous: Any, shutdown: Callable[[], None], mid_record: Callable[[], bool],
                 wait_s: float) -> None:
        self.previous = previous
        self._shutdown = shutdown
        self._mid_record = mid_record
        self.wait_s = wait_s
        self.thread = ShutdownThread(shutdown, self._after_shutdown)
        self.calls = self.deferred = 0
        self.started = self.acted = 0  # shutdown rounds asked for, and rounds whose previous action was taken
        self.waiting = 0  # handler frames waiting on the thread now
        self._deadline = 0.0  # when the outermost of them stops waiting
        self.watch: StuckMainWatch | None = None  # set when faulthandler could be chained in front of us
        self._claim_lock = threading.RLock()  # reentrant: a nested handler call may take it again

    def __call__(self, signum: int, frame: Any) -> None:
        self.calls += 1
        if self.watch is not None:
            self.watch.taken_by_handler()
        if self.thread.closed:  # a fork child that could not put back its previous handler: no thread here
            self._shutdown()
            self._act(signum, frame)
            return
        if self.deferred < MAX_DEFERRALS and self._mid_record():
            self.deferred += 1
            seen = self.calls
            self.thread.resend_until = lambda: self.calls > seen
            self.thread.wake(_RESEND)
            return
        if self.thread.rounds_done > self.acted:  # finished while no handler waited: the thread resent it
            self._act(signum, frame)
            return
        target = self.claim()
        if not self.waiting:  # a nested call (below) waits no longer than the call it interrupted
            self._deadline = time.monotonic() + self.wait_s
        deadline = self._deadline
        self.waiting += 1
        try:
            while self.thread.rounds_done < target and self.acted < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.thread.wait_done(min(left, 0.05))
        finally:
            self.waiting -= 1
        if self.acted < target and self.thread.rounds_done >= target:
            self._act(signum, frame)
        # Otherwise a nested handler took it, or the thread waits for a lock this thread holds: this
        # thread goes on, and the thread sends SIGTERM again once it is done (_after_shutdown).

    def claim(self) -> int:
        """Ask for a shutdown round unless one is under way; the round to wait for. The handler and the
        :class:`StuckMainWatch` both ask, on two threads: the lock makes the test and the count one step."""
        with self._claim_lock:
            if self.started == self.thread.rounds_done:
                self.started += 1
                self.thread.wake()
            return self.started

    def _act(self, signum: int, frame: Any) -> None:
        self.acted = self.thread.rounds_done
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            # Die of SIGTERM as we would have without us, so launchers see the same exit status.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        # SIG_IGN, or a handler installed from C (None): the process goes on, as it would have.

    def _after_shutdown(self) -> None:
        # On the shutdown thread. `waiting` is read after `rounds_done` was counted, and a handler that
        # stops waiting looks at `rounds_done` after it stopped: one of the two always sees the other.
        if not self.waiting:
            target = self.thread.rounds_done
            resend(lambda: self.acted >= target)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.thread.close()
        if self.watch is not None:
            self.watch.close()


class StuckMainWatch:
    """Takes the SIGTERM that a main thread stuck in a C call cannot (see the module's docstring).

    ``faulthandler.register(SIGTERM, file=wake_w, all_threads=False, chain=True)``, made after the Python
    handler was installed, writes each SIGTERM's stack into ``wake_w`` before CPython's own C handler
    marks the Python handler due. Only the stack of the thread the signal landed on: a dump of every
    thread reads threads that are running, and crashed a rank once in 48 trials. Linux hands a signal
    sent to the process to its main thread first (ours block SIGTERM); one that lands on a thread
    without Python state (a C++ thread of torch's) writes nothing, and is left to the Python handler,
    as before the watch. The handler empties the pipe each time it runs
    (:meth:`taken_by_handler`); what is still there :data:`STUCK_AFTER_S` later, with no handler call
    in between, came while the main thread ran no Python. ``die`` ends the process by SIGTERM from this
    thread (``otel_train.runtime``); ``taken`` counts the signals this watch took.
    """

    def __init__(self, handler: MainThreadHandler, die: Callable[[], None]) -> None:
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)  # never block a C handler, nor the Python handler that empties it
        self._handler, self._die = handler, die
        self.taken = 0
        self.closed = False

    def start(self) -> None:
        Worker("otel_train.sigterm-watch", self._run).start()

    def close(self) -> None:
        """In a fork child, where the thread does not exist (faulthandler is unregistered first)."""
        self.closed = True
        _close_all(self.wake_r, self.wake_w)

    def taken_by_handler(self) -> None:
        """The Python handler runs: every SIGTERM whose stacks are in the pipe now is its to take."""
        if not self.closed:
            self._empty()

    def _empty(self) -> None:
        try:
            while os.read(self.wake_r, 1 << 16):
                pass
        except (BlockingIOError, OSError):
            pass

    def _unread(self, timeout_s: float | None) -> bool:
        try:
            return bool(select.select([self.wake_r], [], [], timeout_s)[0])
        except (OSError, ValueError):  # closed
            self.closed = True
            return False

    def _run(self) -> None:
        handler = self._handler
        while not self.closed:
            if not self._unread(None):
                continue
            seen = handler.calls
            time.sleep(STUCK_AFTER_S)
            if handler.calls != seen or not self._unread(0):
                continue  # a handler ran: it took these, or will take the newer ones
            self._empty()
            if handler.thread.rounds_done > handler.acted:
                continue  # a round is done, its action due when the main thread returns (the resends)
            self._take()

    def _take(self) -> None:
        handler = self._handler
        self.taken += 1
        target = handler.claim()
        deadline = time.monotonic() + handler.wait_s
        while handler.thread.rounds_done < target and time.monotonic() < deadline:
            time.sleep(RETRY_S)
        if handler.previous == signal.SIG_DFL:
            self._die()  # as without otel-train, a moment later; even if the round waits for a lock
        # A previous Python handler stays due: it runs when the main thread comes back, the round done.


def _close_all(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def die_of_sigterm_off_main() -> None:
    """Put back SIGTERM's default action and send it to this process, from any thread.

    ``signal.signal`` works only on the main thread, so the action is set through libc. Without ctypes
    the process still ends, with the exit status a shell gives a death by SIGTERM."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        if libc.signal(signal.SIGTERM, None) == ctypes.c_void_p(-1).value:  # SIG_ERR
            raise OSError(ctypes.get_errno(), "signal(SIGTERM, SIG_DFL) failed")
    except (ImportError, OSError, AttributeError) as exc:
        _report.report("sigterm default action", f"SIGTERM's default action could not be put back "
                       f"({_report.safe_str(exc)}): the process exits with status 143 instead")
        os._exit(128 + signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
