"""Wire profiling into a running runtime: the step hook, the watchdog's check, the OOM listener."""

from __future__ import annotations

from typing import Any, Callable

from otel_train import _report
from otel_train import context as step_context
from otel_train.profiling.triggers import LOOK_S, Triggers
from otel_train.profiling.schedule import Schedule
from otel_train.profiling.window import Windows


def install(settings: Any, ctx: Any, jsonl: Any, watchdog: Any) -> Callable[[], None] | None:
    """Install what ``settings`` asks for; returns the undo (close an open window, remove the hooks), or
    None when profiling is off (nothing installed: no cost per step at all)."""
    run_dir = settings.save_path or "."
    undo: list[Callable[[], None]] = []
    if settings.memory_snapshot == "on_oom":
        import otel_train.profiling.memory as memory

        listener = memory.install(run_dir, ctx.rank)
        if listener is not None:
            step_context.error_listeners.append(listener)
            undo.append(lambda: step_context.error_listeners.remove(listener))
    ranks = settings.profile_ranks
    scheduled = settings.profile_steps is not None and (ranks == "all" or ctx.rank in (ranks or ()))
    on = settings.profile_on if watchdog is not None else ()
    if (scheduled or on) and jsonl is not None and settings.profile_max_windows > 0:
        windows = Windows(rank=ctx.rank, attempt=ctx.attempt, run_dir=run_dir,
                          schedule=Schedule(settings.profile_steps) if scheduled else None,
                          window_steps=settings.profile_window, max_windows=settings.profile_max_windows,
                          activities=settings.profile_activities, instant=jsonl.instant)
        step_context.step_listeners.append(windows.on_step)
        undo.append(windows.close)
        undo.append(lambda: step_context.step_listeners.remove(windows.on_step)
                    if windows.on_step in step_context.step_listeners else None)
        if on:
            triggers = Triggers(on, windows)
            watchdog.on_look = triggers.look
            watchdog.tick_s = min(watchdog.tick_s, LOOK_S)
            undo.append(lambda: setattr(watchdog, "on_look", None))
    if not undo:
        return None

    def stop() -> None:
        for step in reversed(undo):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the other hooks are still removed
                _report.report_exception("profiling shutdown", exc)

    return stop
