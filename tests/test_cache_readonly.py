"""A run directory the reader cannot write (a colleague's run, a read-only mount): ``summarize`` reads it, writes
nothing into it, and keeps its read cache in the user's cache directory (docs/analysis.md).

Root writes into a read-only directory, and the suite runs as root here: the CLI then runs as an unprivileged
user (``setpriv`` to nobody), so that the directory really is read-only for the reader. Run as another user,
the test needs nothing but the directory's mode.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from analysis_fixtures import Proc, write_run

NOBODY = 65534


def _as_reader() -> list[str]:
    """The command prefix that runs a child as a user who cannot write the run directory."""
    if os.getuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no user to whom a directory is read-only")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the unprivileged reader can reach (pytest's own tree is private to its user)."""
    d = Path(tempfile.mkdtemp(prefix="otel-train-ro-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        for path in [d, *d.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(d, ignore_errors=True)


def _listing(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))}


def test_a_read_only_run_dir_uses_the_user_cache(shared_dir: Path) -> None:
    run, home = shared_dir / "run", shared_dir / "home"
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(30))
        p.shutdown()
    write_run(run, procs)
    for path in [run, *run.rglob("*")]:
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
                   | ((stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH) if path.is_dir() else 0))
    home.mkdir()
    if os.getuid() == 0:
        os.chown(home, NOBODY, NOBODY)
    before = _listing(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "XDG_"))}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / "cache")}
    cmd = [*_as_reader(), sys.executable, "-m", "otel_train.cli", "summarize", str(run), "--json"]
    for _ in range(2):  # the second read is served from the cache the first one wrote
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=shared_dir)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(json.loads(done.stdout)["processes"]) == 2
    assert _listing(run) == before  # nothing written, nothing touched
    entries = list((home / "cache" / "otel-train").glob("*/*.state"))
    assert len(entries) == 2, sorted(p.name for p in (home / "cache").rglob("*"))
    if os.getuid() == 0:
        assert {p.stat().st_uid for p in entries} == {NOBODY}  # written by the reader, not by root
