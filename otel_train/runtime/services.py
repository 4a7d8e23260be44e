"""What ``init`` starts beside the pipeline: the comm recorder, the lifecycle records and hooks, the
watchdog. Each one registers its own undo on the runtime; none of them raises into training code once
started (the checks before the first file, ``check_comm``, raise ``ConfigError``)."""

from __future__ import annotations

import os

from otel_train import _modes, _report, api
from otel_train import context as step_context
from otel_train import schema as S
from otel_train.config import Settings
from otel_train.digest import DigestWriter
from otel_train.errors import ConfigError
from otel_train.runtime.state import Runtime
from otel_train.runtime.wiring import no_instant
from otel_train.watchdog import Watchdog


def check_comm(settings: Settings) -> None:
    """``collectives=on`` that cannot be honoured, or an unwritable ``fr_dir``: one line, before any file."""
    from otel_train.comm.session import check_available

    reason = check_available(settings.collectives)
    if reason is not None:
        raise ConfigError(f"collectives='on' (OTEL_TRAIN_COLLECTIVES) cannot be honoured: {reason}; "
                          "install torch with distributed support or set collectives to 'auto' or 'off'")
    if settings.fr_dir is not None:
        check_fr_dir(settings)


def check_fr_dir(settings: Settings) -> None:
    """Make ``fr_dir``, or say in one line why it cannot be. The default (``<save_path>/flight_recorder``)
    is made once the trace file is open, so a bad ``save_path`` is named as such."""
    try:
        _modes.make_dirs(settings.fr_path)  # 0755 at most, whatever the umask (otel_train._modes)
        if not os.access(settings.fr_path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _report.safe_str(exc)
        raise ConfigError(f"cannot write Flight Recorder dumps in {settings.fr_path!r}: {reason}; "
                          "set fr_dir (OTEL_TRAIN_FR_DIR) to a writable directory") from None


def make_comm(rt: Runtime) -> None:
    # The communication recorder (otel_train.comm): its Flight Recorder environment is set now, before
    # process_start says what it found; its patches and thread start after the watchdog.
    from otel_train.comm.session import CommSession

    tracing, jsonl = api._tracing, rt.jsonl
    if tracing is None:
        return
    rt.comm = CommSession(
        mode=rt.settings.collectives, fr_dir=rt.settings.fr_path, rank=rt.ctx.rank, attempt=rt.ctx.attempt,
        world_size=rt.ctx.world_size, tracer=tracing.tracer,
        instant=jsonl.instant_for if jsonl is not None else no_instant,
        open_entries=jsonl.open_entries if jsonl is not None else None,
        closed_feed=(lambda feed: setattr(jsonl, "closed_entries", feed)) if jsonl is not None else None,
        arrival=jsonl.arrival if jsonl is not None else None, ids=rt.ids,
    )


def start_comm(rt: Runtime) -> None:
    comm = rt.comm
    if comm is None:
        return
    rt.undo.append(comm.stop)
    try:
        comm.start()
    except Exception as exc:  # tracing goes on without comm spans; training never hears of it
        _report.report_exception("starting the comm recorder (no comm.* spans)", exc)


def start_lifecycle(rt: Runtime) -> None:
    from otel_train import record_clock, lifecycle, logbridge
    from otel_train.telemetry import TelemetrySampler

    settings = rt.settings
    if rt.jsonl is not None:
        attrs = lifecycle.process_start_attrs(settings, rt.ctx)
        if rt.comm is not None:
            attrs["comm"] = dict(rt.comm.status)
        attrs["clock"] = record_clock.anchor()  # the records' clock (docs/clock.md): which wall time it started from
        rt.jsonl.instant(S.INSTANT_PROCESS_START, attrs)
    rt.undo.append(lifecycle.install_exception_hooks())
    if settings.log_bridge:
        rt.undo.append(logbridge.install(settings.log_level))
    if settings.telemetry_every > 0:
        sampler = TelemetrySampler(settings.telemetry_sources, settings.telemetry_every)
        step_context.step_listeners.append(sampler.on_step)

        def remove_sampler() -> None:
            if sampler.on_step in step_context.step_listeners:
                step_context.step_listeners.remove(sampler.on_step)
            sampler.close()

        rt.undo.append(remove_sampler)


def start_watchdog(rt: Runtime) -> None:
    # Heartbeats and stall records (otel_train.watchdog), written through the JSONL sink; stopped
    # first at shutdown. A fork child has none until it calls init() itself.
    settings, jsonl = rt.settings, rt.jsonl
    if not settings.watchdog or jsonl is None:
        return
    # The digest (otel_train.digest) is written from the watchdog's thread: none without a trace file.
    digest = DigestWriter(rt.file_path, settings.digest_s) if settings.digest_s and rt.file_path else None
    watchdog = rt.watchdog = Watchdog(jsonl, heartbeat_s=settings.heartbeat_s, stall_min_s=settings.stall_min_s,
                                      stall_factor=settings.stall_factor, digest=digest)
    jsonl.ended = watchdog.ended
    watchdog.start()

    def stop() -> None:
        watchdog.stop()
        jsonl.ended = None  # what shutdown then ends as incomplete is no duration: the final digest leaves it out

    rt.undo.append(stop)
