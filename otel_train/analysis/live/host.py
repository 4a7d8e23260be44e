"""This host's processes, as ``watch`` probes them: whether a pid still runs, and its Python stacks by
``py-spy dump`` (docs/watch.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from otel_train.analysis.stacks import clean_stacks

PY_SPY_TIMEOUT_S = 10.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class HostProbe:
    """Processes on this host: whether a pid still runs, and a py-spy dump of a live one's stacks."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host if host is not None else socket.gethostname()
        beside = Path(sys.executable).with_name("py-spy")  # a venv's bin/ need not be on PATH
        self.py_spy = shutil.which("py-spy") or (str(beside) if beside.is_file() else None)
        self._boot = _boot_time()

    def is_local(self, host: str | None, pid: int | None) -> bool:
        """Whether the process ``pid`` on ``host`` can be probed from here."""
        return bool(pid) and host == self.host

    def alive(self, pid: int, since: float | None = None) -> bool:
        """Whether ``pid`` exists, is not a zombie and, when ``since`` (Unix time) is given, had started
        by then (a later start is another process that reused the pid)."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
            if fields[0] == b"Z":
                return False
            return since is None or self._boot is None or self._boot + int(fields[19]) / _CLK_TCK <= since + 1.0
        except FileNotFoundError:
            return False
        except (OSError, IndexError, ValueError):
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def dump(self, pid: int, first_tid: int | None = None) -> list[dict[str, Any]] | None:
        """Every thread's stack of ``pid`` by ``py-spy dump`` (innermost last), thread ``first_tid`` first,
        then the one holding the GIL; None when py-spy is missing, not permitted, or takes longer than
        :data:`PY_SPY_TIMEOUT_S`."""
        if self.py_spy is None:
            return None
        try:
            done = subprocess.run([self.py_spy, "dump", "--pid", str(pid), "--json", "--full-filenames"],
                                  capture_output=True, timeout=PY_SPY_TIMEOUT_S, check=False)
            threads = json.loads(done.stdout) if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None
        if not isinstance(threads, list):
            return None
        stacks = clean_stacks([_spy_stack(t) for t in threads if isinstance(t, dict)])
        return sorted(stacks, key=lambda s: (s["tid"] != first_tid, not s.get("owns_gil")))


def _boot_time() -> float | None:
    """Unix time this host booted (``btime`` in /proc/stat): process start times count from it."""
    try:
        with open("/proc/stat", "rb") as f:
            return float(next(line.split()[1] for line in f if line.startswith(b"btime ")))
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def _spy_stack(thread: dict[str, Any]) -> dict[str, Any]:
    frames = [f for f in thread.get("frames") or [] if isinstance(f, dict)]
    return {
        "tid": thread.get("os_thread_id") or thread.get("thread_id"),
        "thread": thread.get("thread_name") or "",
        "frames": [f"{f.get('filename')}:{f.get('line')}:{f.get('name')}" for f in reversed(frames)],
        **({"owns_gil": True} if thread.get("owns_gil") else {}),
    }
