"""torch.profiler windows on the ranks and steps that deserve them (docs/profiling.md).

* :mod:`.schedule` — the settings' values (``profile_ranks``, ``profile_steps``, ...) and which steps a
  scheduled window covers; pure, imported by :mod:`otel_train.config`.
* :mod:`.window` — the step-boundary hook that opens and closes windows on the training thread.
* :mod:`.triggers` — the anomaly check (``profile_on``) the watchdog's thread runs at each look.
* :mod:`.output` — where a window's Kineto trace goes and the ``profile`` instant that names it.
* :mod:`.memory` — ``memory_snapshot=on_oom`` (CUDA only).

:func:`start` wires them into a running runtime.
"""

from __future__ import annotations

from typing import Any, Callable


def start(settings: Any, ctx: Any, jsonl: Any, watchdog: Any) -> Callable[[], None]:
    """Install what ``settings`` asks for (:mod:`.install`); returns the undo (a no-op when profiling is off)."""
    if settings.profile_steps is None and not settings.profile_on and settings.memory_snapshot == "off":
        return _nothing  # nothing imported, nothing installed: no cost per step at all
    from otel_train.profiling.install import install

    return install(settings, ctx, jsonl, watchdog) or _nothing


def _nothing() -> None:
    return None
