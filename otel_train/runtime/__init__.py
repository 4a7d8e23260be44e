"""``init`` / ``shutdown``: the tracing runtime of this process, one job per module.

- :mod:`~otel_train.runtime.start`: ``init`` (settings, checks, then everything below, in order);
- :mod:`~otel_train.runtime.wiring`: tracer, processors and sinks; :mod:`~otel_train.runtime.ids`: span ids;
- :mod:`~otel_train.runtime.services`: the comm recorder, lifecycle records and hooks, the watchdog;
- :mod:`~otel_train.runtime.hooks` and :mod:`~otel_train.runtime.signals`: exit, fork and SIGTERM;
- :mod:`~otel_train.runtime.stop`: ``shutdown``; :mod:`~otel_train.runtime.state`: the active runtime.

Startup is strict (``ConfigError``); afterwards nothing here raises into training code.
"""

from __future__ import annotations

# Imported before any TracerProvider exists, on purpose: the SDK's provider re-detects resources in a
# forked child through a ThreadPoolExecutor, and concurrent.futures re-initialises its global lock in
# the child only in its own after-fork hook. Hooks run in registration order, so this module's must be
# registered first, or every fork child (DataLoader workers included) deadlocks in the SDK's hook.
import concurrent.futures.thread  # noqa: F401
from typing import Any

from otel_train.runtime import signals, state
from otel_train.runtime.ids import StepTraceIdGenerator
from otel_train.runtime.signals import SIGTERM_HANDLER_WAIT_S
from otel_train.runtime.start import init
from otel_train.runtime.state import current_settings, is_enabled, trace_file
from otel_train.runtime.stop import SHUTDOWN_FILE_FLOOR_S, SIGTERM_SHUTDOWN_TIMEOUT_S, shutdown
from otel_train.runtime.wiring import TrainingContextProcessor

__all__ = ["SHUTDOWN_FILE_FLOOR_S", "SIGTERM_HANDLER_WAIT_S", "SIGTERM_SHUTDOWN_TIMEOUT_S", "StepTraceIdGenerator",
           "TrainingContextProcessor", "current_settings", "init", "is_enabled", "shutdown", "trace_file"]

_LIVE = {"_active": (state, "active"), "_lock": (state, "lock"), "_end_signal": (state, "end_signal"),
         "_sigterm_handler": (signals, "sigterm_handler"), "_sigterm_watch": (signals, "sigterm_watch"),
         "_sigterm_previous": (signals, "sigterm_previous")}


def __getattr__(name: str) -> Any:
    """The session's live values under their module-level names (``runtime._active``: the active runtime
    or None), read where they are kept, so a reader never sees a stale copy."""
    home = _LIVE.get(name)
    if home is None:
        raise AttributeError(f"module 'otel_train.runtime' has no attribute {name!r}")
    return getattr(*home)
