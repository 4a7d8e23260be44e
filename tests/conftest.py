"""Shared fixtures: no test leaks an active runtime; trace files read back in segment order."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

import otel_train
from otel_train import schema as S

ReadRecords = Callable[..., list[dict]]


@pytest.fixture(scope="session", autouse=True)
def _children_keep_their_temporary_files_here(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Child processes' temporary files go under this session's pytest directory (which pytest prunes),
    not into /tmp: each torchrun leaves an empty ``torchelastic_*`` directory there, about 55 a suite.
    The name is short: sockets made below it (multiprocessing's forkserver, chromium) stay within
    AF_UNIX's 108 bytes."""
    here = tmp_path_factory.mktemp("t")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(here)
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before


@pytest.fixture(scope="session", autouse=True)
def _read_cache_in_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The read cache (``$XDG_CACHE_HOME/otel-train``; otel_train/analysis/reading/cache.py) of every
    command the suite runs lives under this session's pytest directory, not in the user's home."""
    here = tmp_path_factory.mktemp("xdg")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(here)
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def _no_leaked_runtime() -> Iterator[None]:
    yield
    otel_train.shutdown()


def trace_segments(save_path: str | os.PathLike[str]) -> list[list[Path]]:
    """Each process's files under ``<save_path>/structured_logs``, oldest segment first (.N … .1, active)."""
    log_dir = Path(save_path) / S.STRUCTURED_LOGS_DIR
    by_active: dict[str, list[tuple[int, Path]]] = {}
    for path in log_dir.glob(f"*{S.FILE_SUFFIX}*"):
        match = S.FILE_RE.match(path.name)
        if match is None:
            continue
        segment = int(match["segment"] or 0)
        active = path.name if not segment else path.name.rsplit(".", 1)[0]
        by_active.setdefault(active, []).append((segment, path))
    return [[p for _, p in sorted(parts, key=lambda sp: -sp[0])] for _, parts in sorted(by_active.items())]


def _read(save_path: str | os.PathLike[str], *, torn_ok: int = 0) -> list[dict]:
    """Every record of every trace file, per file in segment order. Fails on more than ``torn_ok``
    unparseable lines in all (a kill or a full disk may leave one torn fragment)."""
    records: list[dict] = []
    bad: list[bytes] = []
    for segments in trace_segments(save_path):
        for path in segments:
            for line in path.read_bytes().split(b"\n"):
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except ValueError:
                    bad.append(line)
    assert len(bad) <= torn_ok, f"{len(bad)} unparseable line(s) (allowed {torn_ok}): {[b[:80] for b in bad]}"
    return records


@pytest.fixture
def read_records() -> ReadRecords:
    """``read_records(save_path, *, torn_ok=0) -> list[dict]``: all records under ``structured_logs``."""
    return _read


@pytest.fixture
def traced_env(tmp_path: Path) -> Callable[..., dict[str, str]]:
    """``traced_env(save_path=tmp_path, **extra) -> env`` for a subprocess tracing with the real SDK.

    Drops inherited ``OTEL_*`` variables so the parent's settings never leak into the child.
    """

    def make(save_path: str | os.PathLike[str] = tmp_path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_TRAIN_ENABLED="1", OTEL_TRAIN_SAVE_PATH=os.fspath(save_path), PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    return make


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs to provoke ENOSPC; skips where mounting needs privileges this run lacks."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs to provoke ENOSPC: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to provoke ENOSPC (needs root/CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        mnt.chmod(0o755)  # a tmpfs is mounted 1777: a run directory anyone may write into is refused at init
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)

