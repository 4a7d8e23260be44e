"""Python ``logging`` → ``log`` instants on the current span, so a warning shows up in the trace next
to the step and phase it happened in."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from otel_train import _report, api
from otel_train._report import safe_str
from otel_train.errors import ConfigError
from otel_train.redact import strip_userinfo

LOG_INSTANT = "log"
_MAX_MESSAGE = 2000
# Our own loggers would feed a record back into the pipeline that reports it; the OTel SDK's (an
# exporter failing to connect, logged from its worker thread) would do the same for the exporter.
_IGNORED_PREFIXES = ("otel_train", "opentelemetry")


class TraceLogHandler(logging.Handler):
    """Turns log records at ``level`` and above into ``log`` instants; never raises, never recurses."""

    def __init__(self, level: int) -> None:
        # The handler itself passes everything: records below ``level`` still need _keep_last_resort.
        super().__init__(logging.NOTSET)
        self.min_level = level
        self._busy = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if (
                record.levelno >= self.min_level
                and not record.name.startswith(_IGNORED_PREFIXES)
                and not getattr(self._busy, "on", False)
            ):
                self._busy.on = True
                try:
                    api.log_trace_instant(
                        LOG_INSTANT,
                        level=record.levelname,
                        logger=record.name,
                        message=_message(record),
                        location=f"{record.pathname}:{record.lineno}",
                    )
                finally:
                    self._busy.on = False
            self._keep_last_resort(record)
        except Exception as exc:  # noqa: BLE001 - logging must never break the caller
            _report.report_exception("bridging a log record", exc)

    def _keep_last_resort(self, record: logging.LogRecord) -> None:
        # Without any other handler Python prints WARNING+ to stderr (logging.lastResort); a handler on
        # the root logger, even one that ignores the record, takes that away: print it as Python would.
        last_resort = logging.lastResort
        if last_resort is None or record.levelno < last_resort.level:
            return
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        last_resort.handle(record)


def _message(record: logging.LogRecord) -> str:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - bad %-args: keep the template rather than lose the record
        message = str(record.msg)
    if record.exc_info and record.exc_info[0] is not None:
        message = f"{message} [{record.exc_info[0].__name__}: {safe_str(record.exc_info[1])}]"
    return strip_userinfo(message[:_MAX_MESSAGE])  # a library logging a URL must not leak its password


def install(level: str) -> Callable[[], None]:
    """Attach a :class:`TraceLogHandler` for ``level`` (a level name, e.g. ``"WARNING"``) and above to the
    root logger; returns a function that removes it. Logger levels still apply: the bridge sees what
    the logging configuration lets through."""
    number = logging.getLevelName(level.upper()) if isinstance(level, str) else None
    if not isinstance(number, int):
        raise ConfigError(f"invalid log level {level!r}: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    handler = TraceLogHandler(number)
    root = logging.getLogger()
    root.addHandler(handler)

    def uninstall() -> None:
        root.removeHandler(handler)

    return uninstall
