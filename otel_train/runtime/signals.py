"""SIGTERM while tracing: a handler chained in front of the one that was there (main thread), or a
``faulthandler`` watcher (``init`` off the main thread); either has ``shutdown`` run on a thread of
its own and then takes the previous action (otel_train/sigterm.py; docs/runtime.md, "Processes,
signals and forks"). Also SIGTERM around ``fork``: blocked in the forking thread, and put back as it
was before ``init`` in the child.

A SIGTERM that reaches a fork child before CPython's own after-fork code runs is lost: that code
clears the flags its C-level handler set, so a Python handler never runs and the child lives on
(a multiprocessing.Pool worker terminated right after its fork then blocks its pool's join
forever). So the forking thread blocks SIGTERM around fork(); the child puts back the handler that
was there before ours (it traces nothing until it calls init) and only then unblocks, so a SIGTERM
that arrived meanwhile acts as it would have without otel-train.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from otel_train import _report, sigterm
import otel_train.runtime.state as state
from otel_train.runtime.stop import SHUTDOWN_FILE_FLOOR_S, SIGTERM_SHUTDOWN_TIMEOUT_S, shutdown

SIGTERM_HANDLER_WAIT_S = SIGTERM_SHUTDOWN_TIMEOUT_S + SHUTDOWN_FILE_FLOOR_S + 1.0
"""How long the SIGTERM handler waits for the shutdown thread before it lets the interrupted code go on
(otel_train/sigterm.py): longer than any shutdown that needs nothing of that code."""

NOT_CHAINED: Any = object()
sigterm_previous: Any = NOT_CHAINED
sigterm_handler: sigterm.MainThreadHandler | None = None  # the main thread's handler, once installed
sigterm_watch: sigterm.ShutdownThread | None = None  # the off-main-thread watcher (faulthandler feeds it)
_fork_mask = threading.local()


def install() -> None:
    """Take SIGTERM as this process allows: nothing in a multiprocessing worker that keeps the default
    action, the watcher off the main thread, the chained handler on it. Once per session."""
    if sigterm_previous is not NOT_CHAINED or sigterm_watch is not None:
        return
    if multiprocessing_child() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        pass  # a multiprocessing worker dies of SIGTERM at once, as without us (below)
    elif threading.current_thread() is not threading.main_thread():
        watch_off_main()  # init off the main thread (Ray Train workers): no Python handler possible
    else:
        chain()  # again in a fork child that calls init: the child dropped ours


def multiprocessing_child() -> bool:
    """Whether this process is a multiprocessing worker (a Pool's, a DataLoader's, any Process).

    There SIGTERM keeps its default action: the kernel ends the worker at once, as without otel-train,
    and the worker's file ends without ``process_end`` (what its writer thread had not yet written is
    lost, as on SIGKILL; docs/runtime.md). ``Pool.terminate`` and DataLoader shutdown SIGTERM workers
    that may be anywhere, and a worker must die of it: with a handler of ours it did not, within 16 – 300
    pools beside a busy loop (once in 40 runs of the fault suite), and the pool's ``join`` waited
    forever. The worker's main thread sits in its task queue's semaphore, and a SIGTERM that landed in
    ``init`` (deferred by the Python handler, or taken by the C-level watcher used off the main thread)
    was sometimes never acted on. A worker that leaves normally still ends its file cleanly
    (``otel_train.runtime.hooks.shutdown_at_multiprocessing_exit``)."""
    mp = sys.modules.get("multiprocessing")
    try:
        return mp is not None and mp.parent_process() is not None
    except Exception:  # noqa: BLE001 - a multiprocessing we do not know: the main-thread handler
        return False


def chain() -> None:
    global sigterm_handler, sigterm_previous
    previous = signal.getsignal(signal.SIGTERM)
    handler = sigterm.MainThreadHandler(previous, _shutdown_on_signal, mid_record, SIGTERM_HANDLER_WAIT_S)
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        handler.close()
        return
    handler.start()
    sigterm_handler, sigterm_previous = handler, previous
    _watch_stuck_main(handler)


def _watch_stuck_main(handler: sigterm.MainThreadHandler) -> None:
    """Chain ``faulthandler``'s C handler in front of CPython's, for a SIGTERM that lands while the main
    thread is stuck in a C call (otel_train/sigterm.py, :class:`sigterm.StuckMainWatch`). Without it such
    a SIGTERM waits for the call to return, where the process would have died at once without us."""
    watch = sigterm.StuckMainWatch(handler, _die_of_sigterm)
    try:
        import faulthandler

        faulthandler.register(signal.SIGTERM, file=watch.wake_w, all_threads=False, chain=True)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        watch.close()
        _report.report("sigterm stuck main",
                       f"faulthandler could not watch SIGTERM ({_report.safe_str(exc)}): a SIGTERM that comes while "
                       "the main thread is inside a C call (a collective that waits for a peer) waits for that call")
        return
    handler.watch = watch
    watch.start()


def _shutdown_on_signal() -> None:
    state.end_signal = "SIGTERM"  # process_end says so (signal): the analyses tell it from a death
    try:
        shutdown(SIGTERM_SHUTDOWN_TIMEOUT_S)
    finally:
        state.end_signal = None


def watch_off_main() -> None:
    """SIGTERM handling when ``init`` runs off the main thread, where Python refuses ``signal.signal``.

    While SIGTERM has its default action, ``faulthandler`` (whose C handler any thread may install)
    takes it: on a SIGTERM it writes the threads' stacks into the shutdown thread's pipe and returns, so
    the process lives on; that thread shuts down (process_end, ``signal``), puts the default action back
    and sends itself SIGTERM: the process dies of it as it would have without us. A handler the main
    thread already set is left alone (it exits, as a rule, and exit runs shutdown). When none of this
    can be set up, one line says so at init.
    """
    global sigterm_watch
    previous = signal.getsignal(signal.SIGTERM)
    if previous != signal.SIG_DFL:
        return
    where = threading.current_thread().name
    watch = None
    try:
        import faulthandler

        watch = sigterm.ShutdownThread(_shutdown_on_signal, _die_of_sigterm, raw=True)
        faulthandler.register(signal.SIGTERM, file=watch.wake_w, all_threads=False, chain=False)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        if watch is not None:
            watch.close()
        _report.report("sigterm off the main thread",
                       f"otel_train.init() ran in thread {where!r}, not the main thread, and no SIGTERM watcher could "
                       f"be set up ({_report.safe_str(exc)}): a SIGTERM will end this process without process_end. "
                       "Call init() from the main thread")
        return
    sigterm_watch = watch
    watch.start()


def _die_of_sigterm() -> None:
    """From a thread (either watcher): faulthandler lets go of SIGTERM, whose default action comes back
    (put back through libc where a Python handler held it), and the process dies of it, as without us."""
    import faulthandler

    faulthandler.unregister(signal.SIGTERM)
    sigterm.die_of_sigterm_off_main()


def _unwatch_in_child() -> None:
    # A fork child must not feed its parent's watcher (the pipe is shared): SIGTERM acts by default there.
    global sigterm_watch
    watch, sigterm_watch = sigterm_watch, None
    if watch is None:
        return
    import faulthandler

    faulthandler.unregister(signal.SIGTERM)
    watch.close()


def before_fork() -> None:
    if sigterm_previous is not NOT_CHAINED or sigterm_watch is not None:
        _fork_mask.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def after_fork_in_parent() -> None:
    old = getattr(_fork_mask, "old", None)
    if old is not None:
        _fork_mask.old = None
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def restore_in_child() -> None:
    global sigterm_previous, sigterm_handler
    _unwatch_in_child()
    if sigterm_handler is not None:
        # Its threads are not in this process: its pipes go, and faulthandler, which writes into the
        # parent's watch pipe, lets go of SIGTERM first. Where the previous handler cannot be put back
        # (one installed from C), it stays, and shuts down in place, as before there were threads.
        if sigterm_handler.watch is not None:
            import faulthandler

            faulthandler.unregister(signal.SIGTERM)
        sigterm_handler.close()
    if sigterm_previous is not NOT_CHAINED:
        try:
            signal.signal(signal.SIGTERM, sigterm_previous)
        except (ValueError, OSError, TypeError):  # a previous handler installed from C: leave ours
            pass
        else:
            sigterm_previous = NOT_CHAINED
            sigterm_handler = None  # a later init in this child installs a handler of its own
    after_fork_in_parent()  # the same mask restore, now in the child


def mid_record() -> bool:
    """Whether this thread holds the runtime's lock, the JSONL processor's (a record in progress) or an
    export processor's (a span being queued). The shutdown thread needs each of them, so a SIGTERM that
    lands there is taken again 5 ms later rather than waited out (otel_train/sigterm.py)."""
    if state.lock._is_owned():  # type: ignore[attr-defined]
        return True
    rt = state.active
    if rt is None:
        return False
    return (rt.jsonl is not None and rt.jsonl.holds_lock()) or any(p.holds_lock() for p in rt.batch_processors)
