"""Output targets that are not regular files, and outputs made under ``umask 000``.

Findings: ``otel-train export RUN -o /dev/null`` run as root renamed its temporary over the device; a
FIFO given as ``-o`` was replaced the same way (its reader waited forever) and ``stats --csv FIFO``
blocked opening it; ``whatif --plot RUN/analysis/heat.png`` under ``umask 000`` made ``analysis/`` 0777
and the image 0666. What must hold (otel_train/analysis/outputs.py): ``export -o``, ``whatif --plot`` and
``stats --csv`` refuse a FIFO, a character device, a socket or a directory in one line (exit 2), never
hang and leave the target as it was; ``export -o -`` streams to stdout the bytes it would write to a
file; everything the CLI makes (folders, image, CSV, export, the read cache) is neither group- nor
world-writable under any umask.

The tests run as root: the device is a node of their own (``os.mknod``, the numbers of ``/dev/null``) in
the test's folder, never ``/dev/null`` itself.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from faultlib import reported
from typer.testing import CliRunner

from otel_train.cli import app


def _run(path: Path) -> Path:
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(8))
        p.shutdown()
    write_run(path, procs)
    return path


def _commands(run: Path, target: Path) -> list[list[str]]:
    return [["export", str(run), "-o", str(target)], ["whatif", str(run), "--plot", str(target)],
            ["stats", str(run), "--csv", str(target)]]


def _special(kind: str, path: Path) -> Path | None:
    """Make a ``kind`` at ``path`` (named *.png so --plot's suffix rule is not what refuses it)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    elif kind == "socket":
        if len(str(path).encode()) >= 100:
            return None  # AF_UNIX's path limit; the other kinds still run
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
    else:
        path.mkdir()
    return path


def _same(kind: str, st: os.stat_result, path: Path) -> bool:
    now = os.lstat(path)
    return (now.st_ino, stat.S_IFMT(now.st_mode), now.st_rdev) == (st.st_ino, stat.S_IFMT(st.st_mode), st.st_rdev)


def test_a_fifo_as_output_is_refused_and_nothing_hangs(tmp_path: Path) -> None:
    holds = ("export -o FIFO, whatif --plot FIFO, stats --csv FIFO (each its own process, 60 s bound): exit 2, one "
             "line naming the option, the FIFO still the same FIFO")
    run = _run(tmp_path / "run")
    commands = _commands(run, tmp_path / "out.png")
    with reported("output target is a FIFO", holds, len(commands)):
        for args in commands:
            target = _special("fifo", tmp_path / "out.png")
            st = os.lstat(target)
            try:
                done = subprocess.run([sys.executable, "-m", "otel_train.cli", *args], capture_output=True, text=True,
                                      timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{args[0]}: hung on a FIFO target")
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and "FIFO" in lines[0], (args, done.stderr)
            assert _same("fifo", st, target), f"{args[0]} replaced the FIFO"
            target.unlink()


@pytest.mark.parametrize("kind", ["chardev", "socket", "directory"])
def test_a_device_socket_or_folder_as_output_is_refused(tmp_path: Path, kind: str) -> None:
    holds = ("export -o, whatif --plot and stats --csv at a character device (a node of /dev/null's numbers), a "
             "socket or a directory: exit 2, one line, the target unchanged")
    run = _run(tmp_path / "run")
    target = _special(kind, tmp_path / "o.png")
    if target is None:
        pytest.skip("the socket's path is past AF_UNIX's limit here")
    st = os.lstat(target)
    commands = _commands(run, target)
    with reported(f"output target is a {kind}", holds, len(commands)):
        for args in commands:
            res = CliRunner().invoke(app, args)
            assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, (args, res.output)
            assert _same(kind, st, target), f"{args[0]} replaced the {kind}"
        if kind == "chardev":
            assert stat.S_ISCHR(os.lstat(target).st_mode) and os.lstat(target).st_rdev == os.makedev(1, 3)


def test_export_to_stdout_streams_the_file_bytes(tmp_path: Path) -> None:
    holds = "export -o - (chrome and perfetto) writes to stdout exactly the bytes export -o FILE writes; nothing else"
    run = _run(tmp_path / "run")
    with reported("export -o - streams", holds, 2):
        for fmt in ("chrome", "perfetto"):
            out = tmp_path / f"t.{fmt}"
            assert CliRunner().invoke(app, ["export", str(run), "-f", fmt, "-o", str(out)]).exit_code == 0
            done = subprocess.run([sys.executable, "-m", "otel_train.cli", "export", str(run), "-f", fmt, "-o", "-"],
                                  capture_output=True, timeout=120)
            assert done.returncode == 0, done.stderr
            assert done.stdout == out.read_bytes() and b"wrote stdout" in done.stderr
            assert not (tmp_path / "-").exists() and not (run / "-").exists()


UMASK_CLI = textwrap.dedent(
    """
    import os, sys
    os.umask(0)
    from typer.testing import CliRunner
    from otel_train.cli import app
    run = sys.argv[1]
    for args in (["whatif", run, "--plot", run + "/analysis/heat.png"],
                 ["stats", run, "--csv", run + "/analysis/steps.csv"],
                 ["export", run, "-o", run + "/analysis/traces/t.json"], ["export", run], ["summarize", run]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
    """
)


def test_outputs_under_umask_000_are_not_writable_by_others(tmp_path: Path) -> None:
    holds = ("under umask 000: whatif --plot, stats --csv, export (default and -o in a new folder) and the read cache "
             "make folders 0755 (cache 0700) and files 0644 (cache 0600); nothing group- or world-writable")
    run = _run(tmp_path / "run")
    xdg = tmp_path / "xdg"
    with reported("umask 000 (CLI outputs, read cache)", holds, 5):
        env = dict(os.environ, XDG_CACHE_HOME=str(xdg))
        done = subprocess.run([sys.executable, "-c", UMASK_CLI, str(run)], capture_output=True, text=True, env=env,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        made = [*(run / "analysis").rglob("*"), run / "analysis", *xdg.rglob("*")]
        names = {p.name for p in made}
        assert {"heat.png", "steps.csv", "t.json", "structured_trace.json", "otel-train"} <= names, sorted(names)
        loose = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in made
                 if stat.S_IMODE(p.lstat().st_mode) & 0o022}
        assert loose == {}, loose
