"""A wall-clock step mid-run (issue 19, item 3): the diagnosis must not change.

Real torchrun jobs (gloo on CPU, 3 ranks, one host) under Debian's libfaketime: every rank reads the
host's clock offset from one file (``FAKETIME_TIMESTAMP_FILE``, re-read at every call:
``FAKETIME_NO_CACHE=1``), so writing the file steps the wall clock of the whole "host" at once, and
``DONT_FAKE_MONOTONIC=1`` leaves the monotonic clock alone, as an NTP step or ``date -s`` does
(docs/clock.md, "Clock steps": what libfaketime does here). Steps of -0.5 s, -60 s and +60 s:

* a crash (rank 2 killed inside ``optimizer``; the step at that very moment, the worst case, or at a
  random step before it): ``summarize`` says "crash rank 2" and blames no one else. Before, a 0.5 s
  backward step at the crash turned it into "hang rank 0; hang rank 1" (the peers' later records
  looked earlier than the death);
* a hang (rank 1 stops inside ``data_fetch``; the step at a random step before it, or as it stops):
  ``watch`` (on the real clock) names rank 1. Before, after a 60 s backward step watch reported
  nothing although the process wrote its stall records.

``make test`` runs one trial per case; ``make faults`` (``FAULT_TRIALS``) up to 20 of each offset, two jobs at a time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import declare, dp_steps
from faultlib import reported, trials

from otel_train import schema as S
from otel_train.analysis.live import LiveRun
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize

LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
"""The synchronized build: the plain one's parse of the clock file races between threads (a +60 s step
was seen as +60, -60, +60 by a rank under load; docs/clock.md, "Clock steps")."""
MAX_TRIALS = 20
WATCH_S = 40
"""watch's --timeout, started once rank 1 is in its endless data_fetch: the hang is named within seconds
(``stall_min_s`` 2 s); a +60 s step hid it for a minute before."""
STEPS, FAULT_STEP = 30, 12

needs_faketime = pytest.mark.skipif(not Path(LIB).exists(),
                                    reason="libfaketime is not installed (apt-get install faketime; make test does)")

LAUNCH = r"""
import os, sys
env = dict(os.environ, LD_PRELOAD=sys.argv[1], FAKETIME_TIMESTAMP_FILE=sys.argv[2], FAKETIME_NO_CACHE="1",
           DONT_FAKE_MONOTONIC="1")
os.execve(sys.executable, [sys.executable, *sys.argv[3:]], env)
"""

JOB = r"""
import os, signal, sys, threading, time

# libfaketime 0.9.10 with DONT_FAKE_MONOTONIC=1 fails time.sleep (EINVAL: its clock_nanosleep on
# CLOCK_MONOTONIC is rewritten with the wall offset); Event.wait and select work (docs/clock.md).
time.sleep = lambda s: threading.Event().wait(s)

import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import otel_train as ot

save, mode, steps, fault_step, offset, step_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
clock_file = os.environ["FAKETIME_TIMESTAMP_FILE"]

def step_clock():
    # One rename: libfaketime re-reads the file at every call, and a truncated-then-written file read in
    # between (an empty offset) stepped the clock back and forth (seen under load).
    with open(clock_file + ".new", "w") as f:
        f.write(offset + "\n")
    os.replace(clock_file + ".new", clock_file)

ot.init(save_path=save, enabled=True)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4, 8), torch.randn(4, 2)
for step in range(steps):
    with ot.training_step(step):
        if rank == 0 and step_at != "fault" and step == int(step_at):
            step_clock()
        with ot.log_trace_span("data_fetch"):
            threading.Event().wait(0.01)
            if mode == "hang" and rank == 1 and step == fault_step:
                if step_at == "fault":
                    step_clock()
                threading.Event().wait()  # stops here for good
        with ot.log_trace_span("forward"):
            loss = nn.functional.mse_loss(model(x), y)
        with ot.log_trace_span("backward"):
            loss.backward()
        with ot.log_trace_span("optimizer"):
            opt.step()
            opt.zero_grad()
            if mode == "crash" and rank == 2 and step == fault_step:
                if step_at == "fault":
                    step_clock()
                threading.Event().wait(0.5)  # the peers are past this step's all-reduce, waiting in the next
                os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
ot.shutdown()
os._exit(0)  # DDP keeps gloo's threads past destroy_process_group: no finalizing under them (docs/comm.md, "Exit")
"""


def _files(root: Path, tag: str) -> tuple[Path, Path]:
    launch, job = root / f"launch-{tag}.py", root / f"job-{tag}.py"  # one pair a job: trials run side by side
    launch.write_text(LAUNCH)
    job.write_text(JOB)
    return launch, job


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH", "FAKETIME", "LD_PRELOAD"))}
    env.update(OMP_NUM_THREADS="1", OTEL_TRAIN_HEARTBEAT_S="1", OTEL_TRAIN_STALL_MIN_S="2")
    return env


def _job(root: Path, save: Path, mode: str, offset: str, step_at: str) -> list[str]:
    launch, job = _files(root, save.name)
    clock = root / f"clock-{save.name}"
    clock.write_text("+0s\n")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(launch), LIB,
            str(clock), str(job), str(save), mode, str(STEPS), str(FAULT_STEP), offset, step_at]


def _kill_job(save: Path) -> None:
    """SIGKILL every process whose command line names this run directory (the ranks, torchrun)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(save).encode() in cmd and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def _wait_for_hang(save: Path, job: subprocess.Popen, timeout_s: float = 240.0) -> None:
    """Until rank 1 has begun the ``data_fetch`` it never leaves (a loaded machine starts a job in 10 to 40 s)."""
    deadline = time.monotonic() + timeout_s
    marker = (f'"event":"data_fetch_start"', f'"step":{FAULT_STEP},')
    while time.monotonic() < deadline and job.poll() is None:
        for path in (save / S.STRUCTURED_LOGS_DIR).glob(f"*rank_1.*{S.FILE_SUFFIX}"):
            if any(all(m in line for m in marker) for line in path.read_text(errors="replace").splitlines()):
                return
        time.sleep(0.5)
    raise AssertionError(f"rank 1 did not reach step {FAULT_STEP} (job exit {job.poll()})")


def _cases(offsets: tuple[str, ...]) -> list[tuple[str, str]]:
    """(offset, where) for each trial: the first trial of each offset steps at the fault itself, the others
    at a random step before it."""
    count = min(trials(1), MAX_TRIALS)
    return [(offset, "fault" if i == 0 else str(random.randrange(1, FAULT_STEP))) for offset in offsets
            for i in range(count)]


def _assert_in_order(save: Path, offset: str, where: str) -> None:
    """Within each process, the training thread's records are in time order (the comm recorder's thread
    writes its ops later, with their own times)."""
    for path in (save / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}"):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        main = [r["ts"] for r in records if r.get(S.TID) == r.get(S.PID) and not r[S.NAME].startswith(S.COMM_PREFIX)]
        assert main == sorted(main), (offset, where, path.name)

def _assert_step_recorded(save: Path, offset: str) -> None:
    """A process that lived on after the step wrote a ``clock_step`` instant saying by how much."""
    seen = []
    for path in (save / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}"):
        seen += [json.loads(line)[S.ATTRS]["step_s"] for line in path.read_text().splitlines()
                 if f'"{S.INSTANT_CLOCK_STEP}"' in line]
    assert seen and all(abs(step - float(offset[:-1])) < 1.0 for step in seen), (offset, seen)


def _crash_culprits(summary: dict) -> list[tuple[str, int | None]]:
    return [(f["kind"], f["rank"]) for f in summary["findings"] if f["kind"] in ("crash", "hang")]


@needs_faketime
def test_a_clock_step_does_not_change_a_crash(tmp_path: Path) -> None:
    cases = _cases(("-0.5s", "+60s", "-60s")) if trials(1) > 1 else [("-60s", "3")]
    holds = ("3 ranks, rank 2 SIGKILLed inside optimizer; the host's wall clock steps -0.5 s / +60 s / -60 s "
             "at the crash or at a random step before: summarize says crash rank 2 and nothing else about "
             "ranks 0, 1, nor does watch; every process's spans in order, durations positive; the step is recorded")
    with reported("wall-clock step mid-run: a crash (libfaketime)", holds, len(cases)):
        _side_by_side(_crash_trial, tmp_path, cases)


def _side_by_side(trial, tmp_path: Path, cases: list[tuple[str, str]]) -> None:
    """Each case's trial; with more than one (``make faults``), two jobs at a time (each job's ranks
    mostly wait: two 3-rank jobs share the two cores), every failure raised."""
    if len(cases) == 1:
        trial(tmp_path, 0, *cases[0])
        return
    with ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(trial, tmp_path, i, offset, where) for i, (offset, where) in enumerate(cases)]:
            done.result()


def _crash_trial(tmp_path: Path, i: int, offset: str, where: str) -> None:
    save = tmp_path / f"crash{i}"
    subprocess.run(_job(tmp_path, save, "crash", offset, where), env=_env(), capture_output=True,
                   text=True, timeout=300, start_new_session=True)
    _kill_job(save)
    summary = summarize(save)
    culprits = _crash_culprits(summary)
    assert culprits and culprits[0] == ("crash", 2), (offset, where, summary["findings"])
    assert all(rank == 2 for _, rank in culprits), (offset, where, summary["findings"])
    for d in load_run(save, warn=lambda _: None).processes:  # no step inside a duration
        for name, series in d.phases.items():
            assert 0 <= min(series.durs) and max(series.durs) < 30_000, (offset, where, d.rank, name)
    _assert_in_order(save, offset, where)
    live = LiveRun(save, warn=lambda _: None, background=False)  # watch, on the finished run
    events = live.poll() + live.poll()
    live.close()
    seen = [(e["finding"]["kind"], e["finding"]["rank"]) for e in events
            if e["type"] == "finding" and e["finding"]["kind"] in ("crash", "hang")]
    assert seen and seen[0] == ("crash", 2) and all(rank == 2 for _, rank in seen), (offset, where, seen)
    if where != "fault" and abs(float(offset[:-1])) >= 1:
        _assert_step_recorded(save, offset)


@needs_faketime
def test_a_clock_step_does_not_hide_a_hang_from_watch(tmp_path: Path) -> None:
    cases = _cases(("-60s", "-0.5s", "+60s")) if trials(1) > 1 else [("+60s", "6")]
    holds = ("3 ranks, rank 1 stops inside data_fetch; the host's wall clock steps -60 s / -0.5 s / +60 s as it "
             "stops or at a random step before: watch (on the real clock) names hang rank 1 within 40 s")
    with reported("wall-clock step mid-run: a hang, watched live (libfaketime)", holds, len(cases)):
        _side_by_side(_hang_trial, tmp_path, cases)


def _hang_trial(tmp_path: Path, i: int, offset: str, where: str) -> None:
    save = tmp_path / f"hang{i}"
    job = subprocess.Popen(_job(tmp_path, save, "hang", offset, where), env=_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_hang(save, job)
        watch = subprocess.run([sys.executable, "-m", "otel_train.cli", "watch", str(save), "--json",
                                "--exit-on", "hang,crash", "--timeout", str(WATCH_S)], env=_env(),
                               capture_output=True, text=True, timeout=150)
    finally:
        _kill_job(save)
        job.wait(timeout=60)
    events = [json.loads(line) for line in watch.stdout.splitlines() if line.startswith("{")]
    found = [e["finding"] for e in events if e["type"] == "finding"]
    assert found, (offset, where, watch.stdout[-2000:], watch.stderr[-2000:])
    # Every finding, of every kind: the one hang, on rank 1, its two peers its victims; nothing else named.
    assert [(f["kind"], f["rank"]) for f in found] == [("hang", 1)], (offset, where, found)
    assert sorted(found[0]["victims"]) == [0, 2], (offset, where, found)


def _anchored(p: Proc, wall_minus_mono_ns: int) -> Proc:
    """``p``'s process_start states its clock's anchor (what the runtime writes)."""
    first = json.loads(p.lines[0])
    first[S.ATTRS]["clock"] = {"wall_ns": wall_minus_mono_ns + 5_000_000_000, "mono_ns": 5_000_000_000}
    p.lines[0] = json.dumps(first)
    return p


def test_a_process_started_after_a_step_is_a_clock_of_its_own(tmp_path: Path) -> None:
    holds = ("3 ranks on one host, rank 2 anchored its clock after a +60 s step of the host's wall clock (its "
             "records 60 s ahead): rank 2 is host vm#1, the estimate puts it at +60 s and the straggler rule "
             "compares arrivals aligned; anchors within 0.1 s are one clock")
    with reported("a process started after a wall-clock step (one host, two anchors)", holds, 1):
        procs = [Proc(rank=r, world_size=3, host="vm", t0=1_700_000_000.0 + (60.0 if r == 2 else 0.0)) for r in range(3)]
        for p, anchor in zip(procs, (1_000, 1_000 + 40_000_000, 60_000_000_000)):
            _anchored(p, 1_700_000_000_000_000_000 + anchor)
        declare(procs)
        dp_steps(procs, range(12))
        for p in procs:
            p.shutdown()
        write_run(tmp_path, procs)
        run = load_run(tmp_path)
        assert [d.host for d in run.processes] == ["vm", "vm", "vm#1"]
        summary = summarize(tmp_path)
        rows = {r["host"]: r for r in summary["clock"]}
        assert sorted(rows) == ["vm", "vm#1"] and abs(rows["vm#1"]["offset_ms"] - 60_000.0) < 5.0, rows
        assert [(f["kind"], f["host"]) for f in summary["findings"] if f["kind"] == "clock_skew"] == [("clock_skew", "vm#1")]
        assert not [f for f in summary["findings"] if f["kind"] in ("straggler", "hang", "crash")], summary["findings"]


SDK_JOB = r"""
import json, sys, time
import otel_train as ot
import opentelemetry.sdk.trace as sdk

ot.init(save_path=sys.argv[1], enabled=True, traces_exporter="jsonl,console", watchdog=False)
wall = time.time_ns
with ot.log_trace_span("across"):
    time.sleep(0.05)
    sdk.time_ns = time.time_ns = lambda: wall() - 60_000_000_000  # the wall clock steps back 60 s
    time.sleep(0.05)
with ot.log_trace_span("after"):
    time.sleep(0.05)
ot.shutdown()
"""


def test_sdk_spans_are_timed_on_the_runtime_clock(tmp_path: Path) -> None:
    holds = ("with OTLP/console configured (the SDK's spans), a 60 s backward step of the wall clock inside a "
             "span: its duration is its own (not -60 s), the next span starts after it ends")
    with reported("wall-clock step inside an SDK span", holds, 1):
        done = subprocess.run([sys.executable, "-c", SDK_JOB, str(tmp_path)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        (path,) = (tmp_path / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}")
        records = [json.loads(line) for line in path.read_text().splitlines()]
        ends = {r[S.NAME]: r for r in records if r[S.KIND] == S.SPAN_END}
        starts = {r[S.NAME]: r for r in records if r[S.KIND] == S.SPAN_START}
        assert 90 <= ends["across"][S.DUR_MS] < 5_000, ends["across"]
        assert starts["after"][S.TS] >= ends["across"][S.TS], (starts["after"], ends["across"])
