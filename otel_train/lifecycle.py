"""Process lifecycle records: what a ``process_start`` instant says, and ``exception`` instants for
uncaught exceptions (main thread and other threads).

Never raises at run time: every probe (versions, git) is bounded and falls back to ``None``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Callable

from otel_train import _report, api
from otel_train._report import safe_str
from otel_train.config import Settings, settings_summary
from otel_train.redact import REDACTED, Redactor, strip_userinfo  # noqa: F401 - REDACTED: read from here too
from otel_train.resource import RunContext

EXCEPTION_INSTANT = "exception"
TRACEBACK_FRAMES = 10

_MAX_ENV_VALUE = 1024
_MAX_MESSAGE = 2000
_GIT_TIMEOUT_S = 2.0
_DISTRIBUTIONS = {"torch": "torch", "opentelemetry_sdk": "opentelemetry-sdk", "otel_train": "otel-train"}


def redacted_env(env: Mapping[str, str] | None = None, redactor: Redactor | None = None) -> dict[str, str]:
    """A copy of the environment with secret values replaced by ``<redacted>`` and long values cut
    (rules: ``otel_train.redact``)."""
    return (redactor or Redactor()).env(os.environ if env is None else env, _MAX_ENV_VALUE)


def _version(distribution: str) -> str | None:
    # importlib.metadata reads the installed metadata: no import of torch (seconds, and CUDA init).
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python, torch, opentelemetry-sdk and otel-train versions (None when not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for key, distribution in _DISTRIBUTIONS.items():
        found[key] = _version(distribution)
    return found


def _git(args: list[str], cwd: str, timeout_s: float) -> str | None:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0")  # never prompt, never lock
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(cwd: str | None = None, timeout_s: float = _GIT_TIMEOUT_S) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git repository at ``cwd``, or None (no repo, no git,
    or slower than ``timeout_s`` in total)."""
    cwd = os.getcwd() if cwd is None else cwd
    deadline = time.monotonic() + timeout_s
    commit = _git(["rev-parse", "HEAD"], cwd, timeout_s)
    if not commit:
        return None
    left = deadline - time.monotonic()
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd, left) if left > 0 else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def process_start_attrs(settings: Settings, ctx: RunContext) -> dict[str, Any]:
    """Attributes of the ``process_start`` instant: resolved settings, versions, git state, argv, cwd,
    a redacted environment snapshot and the host name. Secrets are redacted (``otel_train.redact``,
    plus the ``redact`` setting) in the environment, argv and every text value."""
    redactor = Redactor(settings.redact)
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was deleted
        cwd = None
    return {
        "settings": _redacted(settings_summary(settings), redactor),
        "launcher": ctx.launcher,
        "run_id_known": ctx.run_id_known,
        "versions": versions(),
        "git": git_state(cwd) if cwd is not None else None,
        "argv": redactor.argv(sys.argv),
        "cwd": None if cwd is None else redactor.text(cwd),
        "executable": redactor.text(sys.executable),
        "hostname": socket.gethostname(),
        "env": redacted_env(redactor=redactor),
    }


def _redacted(summary: dict[str, Any], redactor: Redactor) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return redactor.text(value)
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value

    return {key: clean(value) for key, value in summary.items()}


def traceback_summary(tb: TracebackType | None, limit: int = TRACEBACK_FRAMES) -> list[str]:
    """The innermost ``limit`` frames of ``tb`` as ``file:line:function``, outermost first."""
    frames = traceback.extract_tb(tb)[-limit:] if tb is not None else []
    return [f"{frame.filename}:{frame.lineno}:{frame.name}" for frame in frames]


def record_exception(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None, thread: str
) -> None:
    """Write an ``exception`` instant for an uncaught exception; never raises."""
    try:
        message = strip_userinfo(safe_str(exc, _MAX_MESSAGE)) if exc is not None else ""
        api.log_trace_instant(
            EXCEPTION_INSTANT,
            type=f"{exc_type.__module__}.{exc_type.__qualname__}"
            if exc_type.__module__ != "builtins"
            else exc_type.__qualname__,
            message=message,
            traceback=traceback_summary(tb),
            thread=thread,
        )
    except Exception as exc:  # noqa: BLE001 - an excepthook must never fail in its turn
        _report.report_exception("recording an uncaught exception", exc)


def install_exception_hooks() -> Callable[[], None]:
    """Chain ``sys.excepthook`` and ``threading.excepthook``: an uncaught exception writes an
    ``exception`` instant, then the previous hook runs. Returns a function that uninstalls both."""
    previous_sys = sys.excepthook
    previous_threading = threading.excepthook

    def sys_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        record_exception(exc_type, exc, tb, threading.current_thread().name)
        previous_sys(exc_type, exc, tb)

    def threading_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not SystemExit:  # SystemExit in a thread is a normal way to end it
            record_exception(args.exc_type, args.exc_value, args.exc_traceback,
                             args.thread.name if args.thread is not None else "?")
        previous_threading(args)

    sys.excepthook = sys_hook
    threading.excepthook = threading_hook

    def uninstall() -> None:
        # Only undo our own hook: someone may have chained theirs on top since.
        if sys.excepthook is sys_hook:
            sys.excepthook = previous_sys
        if threading.excepthook is threading_hook:
            threading.excepthook = previous_threading

    return uninstall
