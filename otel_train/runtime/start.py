"""``init``: settings, run context and the checks that raise ``ConfigError`` before training starts;
then the pipeline (otel_train.runtime.wiring), the process hooks (otel_train.runtime.hooks) and the
services (otel_train.runtime.services), in that order."""

from __future__ import annotations

import os
from typing import Any, Mapping

from otel_train import _report, api, profiling
from otel_train.config import resolve_settings
from otel_train.errors import ConfigError
from otel_train.exporters.otlp import shutdown_processors
from otel_train.resource import detect_run_context
import otel_train.runtime.hooks as hooks
import otel_train.runtime.services as services
import otel_train.runtime.state as state
from otel_train.runtime.stop import quietly
from otel_train.runtime.wiring import build


def init(save_path: str | os.PathLike[str] | None = None, config: Mapping[str, Any] | None = None,
         **overrides: Any) -> None:
    """Start tracing for this process (see docs/settings.md). Raises ConfigError before training starts."""
    with state.lock:
        if state.active is not None:
            raise ConfigError("otel_train.init() was already called in this process; "
                              "call otel_train.shutdown() before initialising again")
        settings = resolve_settings(save_path=None if save_path is None else os.fspath(save_path),
                                    config=config, overrides=overrides)
        if not settings.enabled:
            return
        ctx = detect_run_context(settings)
        services.check_comm(settings)
        _report.reset()  # a new session reports (and counts, for its process_end) afresh
        rt = state.Runtime(settings, ctx)
        try:
            build(rt)
            if settings.fr_dir is None:
                services.check_fr_dir(settings)
        except BaseException:
            _teardown_partial(rt)
            raise
        state.active = rt
        hooks.install()
        hooks.shutdown_at_multiprocessing_exit()
        services.make_comm(rt)
        services.start_comm(rt)  # before process_start, which says what it patched
        services.start_lifecycle(rt)
        services.start_watchdog(rt)
        if rt.watchdog is not None and rt.comm is not None:
            rt.watchdog.on_stall = rt.comm.on_stall
        rt.undo.append(profiling.start(settings, rt.ctx, rt.jsonl, rt.watchdog))  # docs/profiling.md


def _teardown_partial(rt: state.Runtime) -> None:
    api._tracing = None
    quietly(shutdown_processors, rt.batch_processors, 0.5)
    if rt.writer is not None:
        rt.writer.close()
