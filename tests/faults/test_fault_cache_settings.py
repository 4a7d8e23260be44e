"""A bad ``OTEL_TRAIN_CACHE_MB`` (``1G``, ``nan``, ``inf``, a negative) in a fresh process.

It used to be parsed when the cache module was imported, so every reading command exited 1 with a
``ValueError`` line, ``--no-cache`` included. What must hold: the commands that use the cache
(summarize, stats, whatif, export, diff) exit 2 with one line that names the variable; with
``--no-cache`` they ignore it and answer (docs/analysis.md, "Reading").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from analysis_fixtures import Proc, write_run
from faultlib import reported

CASES = [("1G", "summarize"), ("nan", "stats"), ("inf", "whatif"), ("-5", "export"), ("1e400", "diff")]


def _cli(env_value: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OTEL_TRAIN_CACHE_MB=env_value, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "otel_train.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_bad_cache_size_is_one_line_and_ignored_with_no_cache(tmp_path: Path) -> None:
    holds = ("OTEL_TRAIN_CACHE_MB=1G/nan/inf/-5/1e400: summarize, stats, whatif, export and diff exit 2 with one "
             "line naming the variable; with --no-cache each exits 0")
    with reported("OTEL_TRAIN_CACHE_MB not a size", holds, len(CASES)):
        procs = [Proc(rank=r, world_size=2) for r in range(2)]
        for p in procs:
            p.steps(range(5))
            p.shutdown()
        write_run(tmp_path / "run", procs)
        run = str(tmp_path / "run")
        for value, command in CASES:
            args = [command, run, run] if command == "diff" else [command, run]
            if command == "export":
                args += ["-o", str(tmp_path / "t.json")]
            bad = _cli(value, *args)
            lines = bad.stderr.strip().splitlines()
            assert bad.returncode == 2 and len(lines) == 1 and "OTEL_TRAIN_CACHE_MB" in lines[0], (value, command, bad)
            assert "Traceback" not in bad.stderr
            ok = _cli(value, *args, "--no-cache")
            assert ok.returncode == 0, (value, command, ok.stderr[-2000:])
