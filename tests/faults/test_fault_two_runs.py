"""Two runs in one ``save_path`` (issue 19, item 4): two jobs launched into the same directory, with
different run ids, at the same time.

Before: a phantom ``restart`` ("attempt 1 ... made no progress"), job B's ranks named stragglers of
job A, goodput counting B's steps as lost, and ``whatif`` exiting 1 with a TypeError. Now every
command analyses one run, the one started last unless ``--run-id`` picks another, and says which on
stderr (docs/analysis.md, "Several runs in one directory"); an id the directory does not hold is one
line and exit 2; no command prints a Python error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from faultlib import reported

from otel_train.analysis.live import LiveRun
from otel_train.analysis.spans import load_run

CLI = Path(sys.executable).with_name("otel-train")
STEPS = 12
A_MS, B_MS = 2.0, 20.0
"""Each phase's sleep in job a and in job b: a rank of the other job would be a straggler by 18 ms."""
CROSS_RUN_MS = (B_MS - A_MS) / 2
"""A straggler finding this large could only come from the other job's ranks (before: B's named of A).
Within one run, a loaded machine (load 10 on two cores, ``make faults``) can make one rank the
slower in most steps by a few ms, which the straggler rule rightly names."""

JOB = r"""
import os, sys, time
import otel_train as ot

save, steps, phase_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ot.init(save_path=save, enabled=True)
for step in range(steps):
    with ot.training_step(step):
        for name in ("data_fetch", "forward", "backward", "optimizer"):
            with ot.log_trace_span(name):
                time.sleep(phase_ms / 1000.0)
ot.shutdown()
"""


def _launch(script: Path, save: Path, run_id: str, phase_ms: float) -> list[subprocess.Popen]:
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH"))}
        env.update(OTEL_TRAIN_RUN_ID=run_id, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   OTEL_TRAIN_HEARTBEAT_S="0")
        procs.append(subprocess.Popen([sys.executable, str(script), str(save), str(STEPS), str(phase_ms)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return procs


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two_runs")
    script, save = root / "job.py", root / "run"
    script.write_text(JOB)
    job_a = _launch(script, save, "job-a", A_MS)
    time.sleep(1.0)  # job b starts later, and is slower: its ranks would be "stragglers" of job a
    job_b = _launch(script, save, "job-b", B_MS)
    for proc in job_a + job_b:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    return save


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120)


def _across_runs(findings: list[dict]) -> list[dict]:
    """Findings only mixing the two runs would give: a restart, or a straggler by the jobs' gap."""
    return [f for f in findings if f["kind"] == "restart"
            or (f["kind"] == "straggler" and (f.get("excess_ms") or 0.0) >= CROSS_RUN_MS)]


def _clean(done: subprocess.CompletedProcess) -> None:
    for text in (done.stdout, done.stderr):
        assert "Traceback" not in text and "Error:" not in text and "TypeError" not in text, text[-1500:]


COMMANDS = (("summarize", "--json"), ("summarize", "--fast", "--json"), ("stats", "--json"), ("whatif", "--json"))


def test_each_command_analyses_one_run_and_says_which(shared: Path) -> None:
    holds = ("2 jobs (2 ranks each, different run ids) in one save_path: every command analyses the run "
             "started last and says so on stderr; --run-id picks the other; no restart, no straggler by the jobs' gap, no lost "
             "goodput across runs; an unknown id exits 2 with one line; never a Python error")
    with reported("two runs in one save_path", holds, 1):
        for cmd in COMMANDS:
            done = _cli(cmd[0], str(shared), *cmd[1:])
            _clean(done)
            assert done.returncode == 0, (cmd, done.stderr[-1500:])
            assert f"run job-b (2 runs in {shared}; --run-id to pick another)" in done.stderr, (cmd, done.stderr)
        summary = json.loads(_cli("summarize", str(shared), "--json").stdout)
        assert [p["rank"] for p in summary["processes"]] == [0, 1]
        assert not _across_runs(summary["findings"]), summary["findings"]
        assert summary["goodput"]["lost_s"] == 0.0 and summary["goodput"]["restart_s"] == 0.0
        pids = {p["pid"] for p in summary["processes"]}
        picked = _cli("summarize", str(shared), "--json", "--run-id", "job-a")
        assert picked.returncode == 0 and "run job-a (2 runs in" in picked.stderr, picked.stderr
        other = json.loads(picked.stdout)
        assert len(other["processes"]) == 2 and not pids & {p["pid"] for p in other["processes"]}
        assert not _across_runs(other["findings"]), other["findings"]
        for cmd in (("stats",), ("whatif",), ("diff", str(shared)), ("export", "-o", str(shared.parent / "t.json"))):
            done = _cli(cmd[0], str(shared), *cmd[1:], "--run-id", "job-a")
            _clean(done)
            assert done.returncode == 0 and "run job-a (2 runs in" in done.stderr, (cmd, done.stderr[-1500:])
        missing = _cli("summarize", str(shared), "--run-id", "nope")
        assert missing.returncode == 2 and "no run with id 'nope'" in missing.stderr, missing.stderr
        assert len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.stderr
        live = LiveRun(shared, warn=lambda _: None)
        live.poll()
        assert sorted(s.state.run_id for s in live.procs.values()) == ["job-b", "job-b"]
        assert not _across_runs(live.raised), live.raised
        live.close()


def _procs_with_ids(ids: list[str], world: int) -> list[Proc]:
    procs = []
    for rank, rid in enumerate(ids):
        p = Proc(rank % world, world_size=world, t0=1.7e9 + 100 * (rank // world))
        p.steps(range(3))
        p.shutdown()
        p.lines = [json.dumps({**json.loads(line), "run_id": rid}) for line in p.lines]
        procs.append(p)
    return procs


def test_made_up_run_ids_part_runs_only_when_whole(tmp_path: Path) -> None:
    holds = ("ranks of one job without a launcher id (each made up its own run id) are one run; single-process "
             "runs with made-up ids are runs of their own")
    with reported("run ids made up by each process (no launcher id)", holds, 2):
        notes: list[str] = []
        write_run(tmp_path / "job", _procs_with_ids(["20261202-010000-aaaaaaaa", "20261202-010000-bbbbbbbb"], 2))
        assert [d.rank for d in load_run(tmp_path / "job", warn=notes.append).processes] == [0, 1] and not notes
        write_run(tmp_path / "two", _procs_with_ids(["20261202-010000-aaaaaaaa", "20261202-010500-cccccccc"], 1))
        run = load_run(tmp_path / "two", warn=notes.append)
        assert [d.run_id for d in run.processes] == ["20261202-010500-cccccccc"]
        assert notes == [f"run 20261202-010500-cccccccc (2 runs in {tmp_path / 'two'}; --run-id to pick another)"]
