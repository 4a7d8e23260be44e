"""Process hooks installed by the first ``init``: ``shutdown`` at exit (atexit, and multiprocessing's
exit path), SIGTERM (otel_train.runtime.signals), and fork: a forked child traces nothing until it
calls ``init`` itself."""

from __future__ import annotations

import atexit
import os
import sys

from otel_train import api
from otel_train import context as step_context
import otel_train.runtime.signals as signals
import otel_train.runtime.state as state
from otel_train.runtime.stop import shutdown

_installed = False


def install() -> None:
    global _installed
    if not _installed:
        _installed = True  # atexit and fork hooks are inherited by fork children
        atexit.register(shutdown)
        os.register_at_fork(before=signals.before_fork, after_in_parent=signals.after_fork_in_parent,
                            after_in_child=_after_fork_in_child)
    signals.install()


def shutdown_at_multiprocessing_exit() -> None:
    # A multiprocessing fork/forkserver worker leaves through os._exit, which skips atexit; its exit
    # path still runs multiprocessing's own finalizers, so a worker that called init() ends cleanly.
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:
        import multiprocessing.util

        multiprocessing.util.Finalize(None, shutdown, exitpriority=0)


def _after_fork_in_child() -> None:
    # A forked child (DataLoader worker, multiprocessing) must never write into its parent's file:
    # it traces nothing until it calls init() itself, which opens a file of its own and, being a new
    # process, counts relative steps from its own first step.
    state.active = None
    api._tracing = None
    signals.restore_in_child()
    step_context.step_listeners.clear()
    step_context.reset()
