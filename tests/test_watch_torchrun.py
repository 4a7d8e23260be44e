"""``otel-train watch --json`` beside real torchrun jobs (gloo on CPU), started before the first trace
file exists: the finding's kind, rank and phase, no victim named, and the latency from the fault.

Thresholds are short for a small model: OTEL_TRAIN_STALL_MIN_S=3, OTEL_TRAIN_HEARTBEAT_S=1, so the
target is max(3 s, 5 × p99 step) + 5 s from the moment the culprit's span began. Each test prints its
latency (``pytest -s``) for the README table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import ReadRecords
from contention import cpu_waits, starved

from otel_train import schema
from otel_train.analysis.spans import load_run
from otel_train.phases import DATA_FETCH, FORWARD, OPTIMIZER, STEP

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
STALL_MIN_S = 3.0
STALL_FACTOR = 5.0
SMALL = ["--hidden", "32", "--batch-size", "16", "--checkpoint-every", "0", "--eval-every", "0", "--timeout-s", "60"]


@dataclass
class Watched:
    events: list[dict[str, Any]]
    code: int
    stderr: str
    run: Path

    def findings(self, *kinds: str) -> list[dict[str, Any]]:
        return [e["finding"] for e in self.events if e["type"] == "finding" and (not kinds or e["finding"]["kind"] in kinds)]

    def target_s(self) -> float:
        """max(stall_min_s, stall_factor × the run's p99 step time) + 5 s."""
        steps = [d.phases[STEP].durs for d in load_run(self.run, warn=lambda _: None).processes if STEP in d.phases]
        p99 = float(np.quantile(np.concatenate(steps), 0.99)) / 1000.0 if steps else 0.0
        return max(STALL_MIN_S, STALL_FACTOR * p99) + 5.0


def watch_job(tmp_path: Path, job: list[str], watch: list[str], *, restarts: int = 0, timeout: float = 150.0,
              **env_extra: str) -> Watched:
    """Start ``watch --json`` on a run directory that does not exist yet, then the torchrun job; return
    when watch exits (the job is killed then if it still runs)."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OMP_NUM_THREADS="1", OTEL_TRAIN_STALL_MIN_S=str(STALL_MIN_S), OTEL_TRAIN_HEARTBEAT_S="1", **env_extra)
    watcher = subprocess.Popen([sys.executable, "-m", "otel_train.cli", "watch", str(run), "--json", *watch],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = open(tmp_path / "job.log", "w")
    launched = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         f"--max-restarts={restarts}", str(EXAMPLE), "--save-path", str(run), *SMALL, *job],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, err = watcher.communicate(timeout=timeout)
    finally:
        watcher.kill()
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
        launched.wait()
        _kill_ranks(run)
        log.close()
    events = [json.loads(line) for line in out.splitlines()]
    assert events and events[-1]["type"] == "end", (out, err, (tmp_path / "job.log").read_text()[-3000:])
    return Watched(events, watcher.returncode, err, run)


def _kill_ranks(run: Path) -> None:
    """Kill every rank of the job still alive: torchrun starts each rank in a session of its own, and a
    rank holding the GIL ignores the SIGTERM torchrun sends, so it would outlive the test for good."""
    for proc in psutil.process_iter(["cmdline"]):
        if str(run) in (proc.info["cmdline"] or []):
            try:
                proc.kill()
            except psutil.Error:
                pass


def _latency(w: Watched, finding: dict[str, Any], scenario: str) -> float:
    event = next(e for e in w.events if e["type"] == "finding" and e["finding"] is not None and e["finding"] == finding)
    latency = event["ts"] - finding["since"]
    target = w.target_s()
    print(f"\nwatch latency, {scenario}: {latency:.2f} s (target {target:.2f} s)")
    assert 0 <= latency <= target, (latency, target)
    return latency


def _one_culprit(w: Watched, kind: str, rank: int, phase: str) -> dict[str, Any]:
    """The only hang, crash or error finding is the culprit's (no victim named)."""
    stops = w.findings("hang", "crash", "error")
    assert [(f["kind"], f["rank"], f["phase"]) for f in stops] == [(kind, rank, phase)], w.events
    return stops[0]


def _frames(finding: dict[str, Any]) -> list[str]:
    return finding["stacks"][0]["frames"]


def test_rank_sleeping_forever_in_forward(tmp_path: Path) -> None:
    w = watch_job(tmp_path, ["--steps", "14", "--hang-rank", "1", "--hang-step", "6", "--hang-phase", FORWARD],
                  ["--exit-on", "hang", "--stacks", "--timeout", "120"])
    assert w.code == 3
    f = _one_culprit(w, "hang", 1, FORWARD)
    assert f["step"] == 6 and f["victims"] == [0]
    assert _frames(f)[-1].endswith(":hang") and any(":inject" in frame for frame in _frames(f))  # its stall record
    _latency(w, f, "rank sleeping in forward")


def test_rank_stuck_in_data_fetch(tmp_path: Path) -> None:
    w = watch_job(tmp_path, ["--steps", "14", "--hang-rank", "1", "--hang-step", "6", "--hang-phase", DATA_FETCH],
                  ["--exit-on", "hang", "--timeout", "120"])
    assert w.code == 3
    f = _one_culprit(w, "hang", 1, DATA_FETCH)
    assert f["step"] == 6 and f["victims"] == [0] and "stacks" not in f  # only with --stacks
    _latency(w, f, "rank stuck in data_fetch")


def test_rank_killed_in_optimizer(tmp_path: Path) -> None:
    w = watch_job(tmp_path, ["--steps", "14", "--hang-rank", "1", "--hang-step", "6", "--hang-phase", OPTIMIZER,
                             "--hang-how", "kill"], ["--exit-on", "crash", "--timeout", "120"])
    assert w.code == 3
    f = _one_culprit(w, "crash", 1, OPTIMIZER)
    assert f["step"] == 6
    latency = _latency(w, f, "rank killed in optimizer")
    assert latency < 2.0  # known from its pid at the next poll, no threshold to wait for


def test_rank_stuck_in_a_regular_expression_holding_the_gil(tmp_path: Path) -> None:
    w = watch_job(tmp_path, ["--steps", "14", "--hang-rank", "1", "--hang-step", "6", "--hang-phase", FORWARD,
                             "--hang-how", "regex"], ["--exit-on", "hang", "--stacks", "--timeout", "120"])
    assert w.code == 3
    # forward's start record was in the kernel before the regex took the GIL (docs/runtime.md, "The write
    # guarantee"): the hang is in forward, at step 6, exactly.
    (f,) = w.findings("hang", "crash", "error")
    assert (f["kind"], f["rank"], f["phase"], f["step"]) == ("hang", 1, FORWARD, 6), w.events
    assert f["victims"] == [0]
    # Not even its watchdog could run: the stacks are py-spy's, the GIL holder first.
    main = f["stacks"][0]
    assert main.get("owns_gil") and any(frame.endswith(":hang") for frame in main["frames"])
    assert main["frames"][-1].endswith(":match")
    _latency(w, f, "rank stuck in a regex holding the GIL")


def test_clean_run_with_a_legitimately_slow_checkpoint_raises_nothing(tmp_path: Path, read_records: ReadRecords) -> None:
    """No hang, no stall, no crash for a 6 s checkpoint. A straggler is admitted only with the kernel's word
    that the machine kept that rank waiting for a CPU (tests/contention.py; the job logs it with
    ``--cpu-wait``): under the suite's load, rank 0 (which alone logs and saves) once arrived last at 11 of
    11 collectives, 1.8 ms after its peer at the median."""
    w = watch_job(tmp_path, ["--steps", "7", "--checkpoint-every", "4", "--slow-rank", "0", "--slow-phase",
                             "checkpoint", "--slow-ms", "6000", "--cpu-wait"], ["--timeout", "120"])
    waits = cpu_waits(read_records(w.run))
    assert sorted(waits) == [0, 1], "each rank logs its wait for a CPU (--cpu-wait)"
    unexplained = [f for f in w.findings() if not starved(f, waits)]
    assert w.code == 0 and unexplained == [] and w.events[-1]["processes"] == 2
    run = load_run(w.run, warn=lambda _: None)
    slowest = max(max(d.phases["checkpoint"].durs) for d in run.processes)
    assert slowest >= 6000 and all(d.ended_cleanly for d in run.processes)  # it was slow, and it ended by itself


def test_rotation_while_watching(tmp_path: Path) -> None:
    w = watch_job(tmp_path, ["--steps", "40", "--hang-rank", "1", "--hang-step", "30", "--hang-phase", FORWARD],
                  ["--exit-on", "hang", "--timeout", "150"],
                  OTEL_TRAIN_MAX_FILE_SIZE_MB="0.01", OTEL_TRAIN_BACKUP_COUNT="1000")
    segments = list((w.run / schema.STRUCTURED_LOGS_DIR).iterdir())
    assert len(segments) > 20  # each rank's file rotated many times while watch followed it
    f = _one_culprit(w, "hang", 1, FORWARD)
    assert f["step"] == 30 and "malformed" not in w.stderr
    _latency(w, f, "rank sleeping in forward, files rotating")


def test_a_new_attempt_appearing(tmp_path: Path) -> None:
    w = watch_job(tmp_path, ["--steps", "8", "--fail-rank", "1", "--fail-step", "3"], ["--timeout", "150"],
                  restarts=1)
    assert w.code == 0  # it ended by itself: the last attempt has no restart left
    errors = w.findings("error")
    assert [(f["rank"], f["attempt"], f["phase"]) for f in errors] == [(1, 0, FORWARD), (1, 1, FORWARD)]
    # Rank 0, stopped (or failing) in backward's all-reduce because rank 1 went away, is no finding.
    restarts = w.findings("restart")
    assert restarts and restarts[0]["attempt"] == 1
    run = load_run(w.run, warn=lambda _: None)
    first = min(d.first_ts for d in run.processes if d.attempt == 1)
    event = next(e for e in w.events if e["type"] == "finding" and e["finding"]["kind"] == "restart")
    print(f"\nwatch latency, new attempt: {event['ts'] - first:.2f} s after its first record")
    assert event["ts"] - first < 3.0
    assert not w.findings("hang", "crash")
