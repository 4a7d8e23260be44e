"""Internal faults: one line on stderr the first time per key, counted every time.

Tracing never raises into training (README "Never break training"): a failing write, encoder,
exporter, hook or listener calls :func:`report` instead. Everything goes through the ``otel_train``
logger, which by default prints to the current ``sys.stderr`` (set your own handlers on that logger to
route it elsewhere); the counts feed the ``process_end`` record and the summary line at shutdown.
Nothing here raises, and it is safe from a signal handler that interrupted a report on the same thread.
"""

from __future__ import annotations

import logging
import sys
import threading

logger = logging.getLogger("otel_train")

_MAX_TEXT = 300


class _Stderr(logging.Handler):
    """Writes the bare message to whatever ``sys.stderr`` is now (pytest, a redirected stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - stderr closed or broken: the counts still tell
            pass

    def handleError(self, record: logging.LogRecord) -> None:  # never a logging traceback
        pass


if not logger.handlers:
    # Like other libraries' root loggers (transformers, urllib3 warnings): visible by default on
    # stderr, even under a root logger configured for ERROR; reconfigure "otel_train" to change that.
    logger.addHandler(_Stderr())
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)

_lock = threading.RLock()  # reentrant: a SIGTERM handler may report while this thread is reporting
_counts: dict[str, int] = {}


def safe_str(obj: object, limit: int = _MAX_TEXT) -> str:
    """``str(obj)`` cut to ``limit`` characters; never raises (a broken ``__str__`` names the type)."""
    try:
        text = str(obj)
    except Exception:  # noqa: BLE001 - user objects may raise anything from __str__
        text = f"<unprintable {type(obj).__name__}>"
    if not isinstance(text, str):
        text = f"<unprintable {type(obj).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, bounded and safe."""
    return f"{type(exc).__name__}: {safe_str(exc)}"


def report(key: str, message: str, count: int = 1) -> bool:
    """Count ``count`` occurrences of ``key``; the first one logs ``otel-train: <message>``.

    Returns whether this was the first occurrence (what was printed). Never raises.
    """
    with _lock:
        seen = _counts.get(key, 0)
        _counts[key] = seen + count
    if seen:
        return False
    try:
        logger.warning("otel-train: %s (reported once; later occurrences are counted)", message)
    except Exception:  # noqa: BLE001 - a broken logging configuration must not break training
        pass
    return True


def report_exception(where: str, exc: BaseException) -> bool:
    """:func:`report` an exception caught at ``where``, keyed by place and exception type."""
    return report(f"{where}:{type(exc).__name__}", f"{where} failed: {describe(exc)}; tracing continues")


def counts() -> dict[str, int]:
    """A copy of every key's count so far."""
    with _lock:
        return dict(_counts)


def total(prefix: str = "") -> int:
    """Occurrences of every key starting with ``prefix``."""
    with _lock:
        return sum(n for key, n in _counts.items() if key.startswith(prefix))


def reset() -> None:
    """Forget every count (a new ``init`` session reports afresh)."""
    with _lock:
        _counts.clear()
