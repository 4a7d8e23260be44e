"""Communication faults on real torchrun jobs (gloo on CPU), diagnosed by summarize, --fast and watch.

Each job injects one fault of issue 16's list through the example scripts' ``--fault`` flags and
must be named with the right culprit, group and seq, and no victim named:

* DDP, one rank skips the metric all-reduce → ``hang`` naming that rank, the group, the seq and the op
  (also live, by ``watch``, within the hang latency bound, and from Flight Recorder dumps alone with
  collectives off and one rank's dump missing);
* DDP, one rank broadcasts where the others all-reduce → ``desync``; one all-reduces another size →
  ``desync``;
* pipeline 2 stages × 2 data-parallel: a slowed stage → ``straggler`` on that stage's rank; a stage
  that stops mid-schedule → ``hang`` naming it, the ranks waiting in send/recv as its victims.

Assertions are on who and what, never on how fast (a loaded machine changes durations, not culprits).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import _read
from contention import cpu_waits, starved, starved_by

from otel_train.analysis import findings as findings_module
from otel_train.analysis.fast import summarize_fast
from otel_train.analysis.findings import straggler_findings
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize

pytest.importorskip("torch.distributed")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DDP = ("--steps", "12", "--eval-every", "0", "--checkpoint-every", "0", "--hidden", "64", "--cpu-wait")
STALL_MIN_S = 3.0
LATENCY_BOUND_S = STALL_MIN_S + 5.0
"""watch's hang latency bound (docs/watch.md): the stall threshold plus 5 s."""


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return out | {"OMP_NUM_THREADS": "1", "OTEL_TRAIN_STALL_MIN_S": str(STALL_MIN_S)} | extra


def launch(script: str, save: Path, ranks: int, *args: str, **extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(EXAMPLES / script), "--save-path", str(save), *args]
    log = open(save.parent / f"{save.name}.log", "wb")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(**extra), start_new_session=True)


def stop(proc: subprocess.Popen[bytes], save: Path, wait_s: float = 0.0) -> None:
    """Wait up to ``wait_s`` for the job to end by itself, then kill it and every rank of it.

    Every rank is stopped (SIGSTOP) before any is killed: killed one after another (or by the launcher's
    death), a waiting rank saw its peer's connection close, failed with gloo's error and wrote its end
    before its own kill came, and a hang read as a crash (seen once in a fresh-clone run)."""
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass
    ranks = _ranks(save)  # torchrun starts ranks in sessions of their own
    _signal(ranks, signal.SIGSTOP)
    _signal(ranks, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _signal(_ranks(save), signal.SIGKILL)  # any the launcher started meanwhile


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _ranks(save: Path) -> list[int]:
    """The processes whose command line names this run directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(save).encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            pass
    return [pid for pid in pids if pid != os.getpid()]


def watch_until(save: Path, kinds: str, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "otel_train.cli", "watch", str(save), "--json", "--exit-on", kinds,
                          "--timeout", str(timeout_s)], capture_output=True, text=True, timeout=timeout_s + 30)
    return [json.loads(line) for line in out.stdout.splitlines()]


def found(summary: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in summary["findings"] if f["kind"] == kind]


def blamed(summary: dict[str, Any], save: Path) -> set[int]:
    """Ranks named by a hang, desync or straggler finding (victims must never be). A straggler the machine
    made is no victim named only with the kernel's word that it waited for a CPU, beyond its peers, about as
    long as it was late (tests/contention.py; DDP jobs log their wait with ``--cpu-wait``): beside a busy
    loop, 3 ranks on 2 cores, a desync run's rank 1 was last at all 9 collectives before the fault, 1.5 ms
    late. Nothing else excuses a finding (a job without ``--cpu-wait`` excuses none)."""
    waits = cpu_waits(_read(save, torn_ok=4))  # a kill may tear each rank's last line
    return {f["rank"] for f in summary["findings"] if f["kind"] in ("hang", "desync", "straggler")
            and not starved(f, waits)}


@pytest.fixture(scope="module")
def skipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """3 ranks: rank 1 skips the metric all-reduce of step 4, watched live until the hang is named."""
    save = tmp_path_factory.mktemp("skip") / "run"
    save.parent.mkdir(exist_ok=True)
    proc = launch("train_ddp.py", save, 3, *DDP, "--fault", "skip-collective", "--fault-rank", "1",
                  "--fault-step", "4", "--timeout-s", "60")
    try:
        events = watch_until(save, "hang")
    finally:
        stop(proc, save)
    return save, events


def test_skipped_collective_is_a_hang_on_the_op(skipped: tuple[Path, list[dict[str, Any]]]) -> None:
    save, _ = skipped
    summary = summarize(save, warn=lambda _: None)
    (hang,) = found(summary, "hang")
    comm = hang["comm"]
    assert hang["rank"] == 1 and comm["op"] == "all_reduce" and comm["missing"] == [1], hang
    assert sorted(comm["waiting"]) == [0, 2] and "metrics" in hang["message"], hang
    assert f"#{comm['seq']}" in hang["message"] and blamed(summary, save) == {1}, summary["findings"]
    fast = summarize_fast(save, warn=lambda _: None)
    (fast_hang,) = found(fast, "hang")
    assert (fast_hang["rank"], fast_hang["comm"]["group"], fast_hang["comm"]["seq"]) == (
        1, comm["group"], comm["seq"])


def test_watch_names_the_skipped_collective_live(skipped: tuple[Path, list[dict[str, Any]]]) -> None:
    save, events = skipped
    hangs = [e for e in events if e["type"] == "finding" and e["finding"]["kind"] == "hang"]
    assert hangs, events
    f = hangs[0]["finding"]
    summary_hang = found(summarize(save, warn=lambda _: None), "hang")[0]
    assert (f["rank"], f["comm"]["group"], f["comm"]["seq"], f["comm"]["op"]) == (
        1, summary_hang["comm"]["group"], summary_hang["comm"]["seq"], "all_reduce")
    assert 1 not in f.get("victims", []) and hangs[0]["ts"] - f["since"] <= LATENCY_BOUND_S, f


@pytest.mark.parametrize("fault", ["desync-op", "desync-size"])
def test_desync_names_the_group_the_seq_and_each_side(fault: str, tmp_path: Path) -> None:
    save = tmp_path / "run"
    proc = launch("train_ddp.py", save, 3, *DDP, "--fault", fault, "--fault-rank", "2", "--fault-step", "3",
                  "--timeout-s", "8")
    try:
        stop(proc, save, wait_s=90)
    finally:
        stop(proc, save)
    summary = summarize(save, warn=lambda _: None)
    (desync,) = found(summary, "desync")
    ops = {int(k): v for k, v in desync["comm"]["ops"].items()}
    assert desync["rank"] == 2 and set(ops) == {0, 1, 2} and ops[0] == ops[1], desync
    if fault == "desync-op":
        assert "broadcast" in ops[2] and "all_reduce" in ops[0], ops
    else:  # the same op, another size: each side's bytes in the message
        assert ops[2] == ops[0] == "all_reduce" and len(set(re.findall(r"(\d+) B", desync["message"]))) == 2, desync
    assert f"seq {desync['comm']['seq']}" in desync["message"] and blamed(summary, save) == {2}, summary["findings"]


@pytest.fixture(scope="module")
def slow_stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pipeline 2 stages x 2 data-parallel: rank 1 (stage 0) 100 ms slower in every microbatch's forward.

    Every forward also waits 20 ms off the CPU, as a stage waits on a GPU (``--gpu-wait-ms``): without it,
    rank 3, idle 100 ms before each of its forwards while rank 1 is slow, ran each forward ~0.25 ms slower
    than its stage twin rank 2 (+1.0 ms a step, 2.7x, 12 of 12 steps, with no longer a wait for a CPU than
    its peers.), and was named a straggler in forward beside rank 1 on a loaded machine (5 runs of 7 here).
    With every rank waking from a wait before its forward, only rank 1 is named."""
    save = tmp_path_factory.mktemp("slow_stage") / "run"
    proc = launch("train_parallel.py", save, 4, "--mode", "pp", "--steps", "12", "--fault", "slow-stage",
                  "--fault-rank", "1", "--slow-ms", "100", "--gpu-wait-ms", "20", "--timeout-s", "60", "--cpu-wait")
    try:
        stop(proc, save, wait_s=240)
        assert proc.returncode == 0, (save.parent / "run.log").read_text()[-3000:]
    finally:
        stop(proc, save)
    return save


def test_slow_pipeline_stage_is_the_straggler(slow_stage: Path) -> None:
    """Rank 1 is named, in forward, and no other rank is named: a straggler beside it only with the kernel's
    word that the machine kept it waiting for a CPU (blamed())."""
    summary = summarize(slow_stage, warn=lambda _: None)
    waits = cpu_waits(_read(slow_stage))
    assert blamed(summary, slow_stage) == {1}, [(f["rank"], f["phase"], f["message"], starved_by(waits, f["rank"]))
                                                for f in summary["findings"]]
    assert {f["kind"] for f in summary["findings"]} == {"straggler"}, summary["findings"]
    top = max(found(summary, "straggler"), key=lambda f: f.get("cost_ms") or 0)
    assert (top["rank"], top["phase"]) == (1, "forward") and top["excess_ms"] > 100, top


def test_waiting_pipeline_stage_is_no_straggler(slow_stage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The victim filter of ``straggler_findings`` on its own: rank 3, stage 1 beside the slow rank 1, waits
    for it in the pipeline's recvs, so its ``pipeline`` phase is as slow as rank 1's; judged without the time
    its comm ops waited for a later member, it is not slower, and is dropped as a victim. The rules after
    it (a phase holding comm ops is left to the arrival rule; a cost of ~0 is absorbed, not applied to a
    pipeline anyway) would drop it too: they are set aside here, so that this rule is the one tested."""
    run = load_run(slow_stage, warn=lambda _: None)
    (group,) = run.groups()
    graph = run.comm[(group[0].source, group[0].attempt)]
    monkeypatch.setattr(findings_module, "_most_specific", lambda group, found: found)
    named = {(f["rank"], f["phase"]) for f in straggler_findings(group, run.phase_order(), graph=graph)}
    # Rank 1 in forward and in pipeline (its own slowness); rank 3's pipeline, all waiting, never. (A
    # rank's forward is the machine's business: blamed() in the test above.)
    assert (1, "forward") in named and (1, "pipeline") in named, named
    assert not [(r, phase) for r, phase in named if phase == "pipeline" and r != 1], named


def test_stopped_pipeline_stage_is_the_hang_and_its_peers_its_victims(tmp_path: Path) -> None:
    save = tmp_path / "run"
    proc = launch("train_parallel.py", save, 4, "--mode", "pp", "--steps", "12", "--fault", "stop-stage",
                  "--fault-rank", "1", "--fault-step", "3", "--timeout-s", "60")
    try:
        events = watch_until(save, "hang")
    finally:
        stop(proc, save)
    summary = summarize(save, warn=lambda _: None)
    (hang,) = found(summary, "hang")
    assert hang["rank"] == 1 and 1 not in hang["comm"]["waiting"] and hang["comm"]["waiting"], hang
    assert blamed(summary, save) == {1}, summary["findings"]
    live = [e["finding"] for e in events if e["type"] == "finding" and e["finding"]["kind"] == "hang"]
    assert live and live[0]["rank"] == 1 and 1 not in live[0].get("victims", []), events


def test_skipped_collective_from_flight_recorder_dumps_alone(tmp_path: Path) -> None:
    """Collectives off: no comm.* span in the files; every rank writes torch's own dump 6 s into the
    hang, rank 2's is then deleted (a missing rank is named, not fatal): the same culprit, group op."""
    save = tmp_path / "run"
    proc = launch("train_ddp.py", save, 3, *DDP, "--fault", "skip-collective", "--fault-rank", "1",
                  "--fault-step", "4", "--timeout-s", "60", "--fr-dump-after", "6", OTEL_TRAIN_COLLECTIVES="off")
    try:
        dumps = save / "flight_recorder"
        deadline = time.monotonic() + 120
        while len(list(dumps.glob("dump.rank_*.pkl"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)  # the last write whole
    finally:
        stop(proc, save)
    assert len(list(dumps.glob("dump.rank_*.pkl"))) == 3, (save.parent / "run.log").read_text()[-3000:]
    for f in save.glob("structured_logs/*.jsonl"):
        assert '"comm.' not in f.read_text().replace('"comm.group"', ""), f  # nothing but the dumps
    (dumps / "dump.rank_2.pkl").unlink()
    warnings: list[str] = []
    summary = summarize(save, warn=warnings.append)
    (hang,) = found(summary, "hang")
    assert hang["rank"] == 1 and hang["comm"]["op"] == "all_reduce" and 1 in hang["comm"]["missing"], hang
    assert any("rank 2" in w for w in warnings), warnings


def test_sigterm_to_the_launcher_ends_ranks_stuck_in_the_hung_collective(tmp_path: Path) -> None:
    """A hang, named live, then stopped the usual way: SIGTERM to torchrun, which sends SIGTERM to every
    rank and SIGKILLs any still alive 30 s later. Both ranks wait inside gloo (C++), where CPython runs
    no Python handler: before the stuck-main watch (otel_train/sigterm.py) rank 0 lived on until that
    SIGKILL and its file had no ``process_end``. Now every rank ends its trace with ``process_end``
    (signal SIGTERM), and the hang is still named on the files so ended."""
    save = tmp_path / "run"
    proc = launch("train_ddp.py", save, 2, *DDP, "--fault", "skip-collective", "--fault-rank", "1",
                  "--fault-step", "4", "--timeout-s", "120")  # gloo's own timeout after torchrun's SIGKILL
    try:
        events = watch_until(save, "hang")
        assert [e for e in events if e["type"] == "finding" and e["finding"]["kind"] == "hang"], events
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        stop(proc, save)
    ends: dict[int, list[dict[str, Any]]] = {}
    for record in _read(save):
        if record["event"] == "process_end":
            ends.setdefault(record["rank"], []).append(record)
    assert sorted(ends) == [0, 1], (save.parent / "run.log").read_text()[-3000:]
    assert all(len(e) == 1 and e[0]["attrs"]["signal"] == "SIGTERM" for e in ends.values()), ends
    (hang,) = found(summarize(save, warn=lambda _: None), "hang")
    assert hang["rank"] == 1 and hang["comm"]["op"] == "all_reduce" and hang["comm"]["missing"] == [1], hang
