"""A run directory the reader cannot write (a colleague's run, a read-only mount): ``summarize`` reads it, writes
nothing into it, and keeps its read cache in the user's cache directory (docs/analysis.md).

Root writes into a read-only directory, and the suite runs as root here: the CLI then runs as an unprivileged
user (``setpriv`` to nobody), so that the directory really is read-only for the reader. Where nobody cannot
reach the checkout (a clone in ``mktemp -d``, mode 0700), the run directory is instead bind-mounted read-only
in a mount namespace of the reader's own (``unshare --mount``), and root reads it there. Run as another
user, the test needs nothing but the directory's mode.
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


SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'


def _as_reader(run: Path, env: dict[str, str]) -> tuple[list[str], int]:
    """The command prefix that runs a child for whom the run directory is read-only, and its uid."""
    if os.getuid() != 0:
        return [], os.getuid()
    probe = [sys.executable, "-c", "import otel_train.cli"]
    if shutil.which("setpriv") and subprocess.run([*SETPRIV, *probe], env=env, capture_output=True).returncode == 0:
        return SETPRIV, NOBODY
    if shutil.which("unshare") and subprocess.run(["unshare", "--mount", "sh", "-c", READ_ONLY_MOUNT, str(run),
                                                   *probe], env=env, capture_output=True).returncode == 0:
        return ["unshare", "--mount", "sh", "-c", READ_ONLY_MOUNT, str(run)], 0
    pytest.skip("running as root, with neither a user who can reach the checkout (setpriv) nor a mount "
                "namespace (unshare): no reader to whom a directory is read-only")


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
    before = _listing(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "XDG_"))}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / "cache")}
    prefix, reader = _as_reader(run, env)
    if reader != os.getuid():
        os.chown(home, reader, reader)
    cmd = [*prefix, sys.executable, "-m", "otel_train.cli", "summarize", str(run), "--json"]
    for _ in range(2):  # the second read is served from the cache the first one wrote
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=shared_dir)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(json.loads(done.stdout)["processes"]) == 2
    assert _listing(run) == before  # nothing written, nothing touched
    entries = list((home / "cache" / "otel-train").glob("*/*.state"))
    assert len(entries) == 2, sorted(p.name for p in (home / "cache").rglob("*"))
    assert {p.stat().st_uid for p in entries} == {reader}  # written by the reader (nobody, where root can drop)
