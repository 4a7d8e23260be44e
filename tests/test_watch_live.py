"""Live rules on synthetic runs written as they grow: the one findings module asked of a live snapshot
(alive and running processes), stall stacks in findings, and :class:`LiveRun` with a controlled clock."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from typer.testing import CliRunner

from otel_train import schema
from otel_train.analysis.findings import findings
from otel_train.analysis.live import UNNAMED_HOLD_S, LiveRun
from otel_train.analysis.spans import load_run
from otel_train.analysis.stacks import describe_stack, user_frames
from otel_train.analysis.summary import summarize
from otel_train.cli import app
from otel_train.phases import BACKWARD, CHECKPOINT, FORWARD

STACK = ["/usr/lib/python3.11/threading.py:1002:_bootstrap", "/home/u/train.py:88:main",
         "/home/u/train.py:40:forward_pass", "/usr/lib/python3.11/re/__init__.py:166:match"]


def _stall(proc: Proc, span: str, open_s: float) -> None:
    proc.instant(schema.INSTANT_STALL, span=span, open_s=open_s, threshold_s=2.0, tid=1,
                 stacks=[{"tid": 7, "thread": "loader", "frames": ["/home/u/data.py:3:load"]},
                         {"tid": 1, "thread": "MainThread", "frames": STACK}])


def _hung_pair(with_stall: bool = True) -> list[Proc]:
    procs = [Proc(rank=r) for r in (0, 1)]
    for p in procs:
        p.steps(range(6))
    procs[0].stop_inside(6, [FORWARD, BACKWARD][:1])
    procs[0].end()  # rank 0 finished forward ...
    procs[0].start(BACKWARD)  # ... and waits in backward's all-reduce
    procs[1].stop_inside(6, [FORWARD])
    if with_stall:
        procs[1].advance(3000)
        _stall(procs[1], FORWARD, 3.0)
    return procs


def test_hang_finding_names_victims_and_carries_the_stalled_threads_stack_first(tmp_path: Path) -> None:
    write_run(tmp_path, _hung_pair())
    hang = summarize(tmp_path)["findings"][0]
    assert (hang["kind"], hang["rank"], hang["phase"], hang["victims"]) == ("hang", 1, FORWARD, [0])
    assert [s["tid"] for s in hang["stacks"]] == [1, 7]
    mine, inner = user_frames(hang["stacks"][0]["frames"])
    assert mine == STACK[1:3] and inner == STACK[3]
    assert describe_stack(hang["stacks"][0]) == "MainThread: u/train.py:88:main > u/train.py:40:forward_pass (in re/__init__.py:166:match)"


def test_summarize_text_shows_the_stalled_threads_own_frames(tmp_path: Path) -> None:
    write_run(tmp_path, _hung_pair())
    done = CliRunner().invoke(app, ["summarize", str(tmp_path)])
    assert done.exit_code == 0
    text = " ".join(done.output.split())  # the console wraps long lines
    assert ("rank 1 stalled in MainThread: u/train.py:88:main > u/train.py:40:forward_pass "
            "(in re/__init__.py:166:match)") in text


def test_no_stacks_key_without_stall_records(tmp_path: Path) -> None:
    write_run(tmp_path, _hung_pair(with_stall=False))
    assert "stacks" not in summarize(tmp_path)["findings"][0]


def test_a_running_process_is_neither_hung_nor_crashed_and_a_dead_one_is_a_crash(tmp_path: Path) -> None:
    procs = [Proc(rank=r) for r in (0, 1)]
    for p in procs:
        p.steps(range(3))
    procs[0].stop_inside(3, [FORWARD])  # rank 0 is mid-step, still making progress
    procs[1].stop_inside(2 + 1, [FORWARD])  # rank 1 died in forward (its pid is gone)
    write_run(tmp_path, procs)
    run = load_run(tmp_path)
    rank0, rank1 = run.processes
    # After the fact both stopped alike in forward and neither shut down: one finding for the group.
    assert [(f["kind"], f["rank"]) for f in findings(run)] == [("hang", None)]
    live = findings(run, alive={rank0}, running={rank0})
    assert [(f["kind"], f["rank"], f["phase"]) for f in live] == [("crash", 1, FORWARD)]
    assert findings(run, alive={rank0, rank1}, running={rank0, rank1}) == []


class FakeHost:
    """A HostProbe for processes that are only files: ``dead`` pids are gone, the rest run; no py-spy."""

    def __init__(self, host: str = "node0") -> None:
        self.host = host
        self.dead: set[int] = set()

    def is_local(self, host: str | None, pid: int | None) -> bool:
        return bool(pid) and host == self.host

    def alive(self, pid: int, since: float | None = None) -> bool:
        return pid not in self.dead

    def dump(self, pid: int, first_tid: int | None = None) -> None:
        return None


class Growing:
    """Processes whose lines reach their files a piece at a time, read by a LiveRun on a fake clock."""

    def __init__(self, run_dir: Path, procs: list[Proc], **live_kwargs: object) -> None:
        self.logs = run_dir / schema.STRUCTURED_LOGS_DIR
        self.procs = procs
        self.written = {id(p): 0 for p in procs}
        self.now = procs[0].t0
        self.host = FakeHost()
        self.live = LiveRun(run_dir, probe=self.host, clock=lambda: self.now, background=False,  # type: ignore[arg-type]
                            **live_kwargs)

    def flush(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for p in self.procs:
            new = p.lines[self.written[id(p)]:]
            if new:
                with open(self.logs / p.file_name, "a") as f:
                    f.write("".join(line + "\n" for line in new))
                self.written[id(p)] = len(p.lines)

    def poll_at(self, seconds_after_last_record: float) -> list[dict]:
        self.flush()
        self.now = max(p.t0 + p.now_ms / 1000 for p in self.procs) + seconds_after_last_record
        return self.live.poll()


def _settings(proc: Proc, stall_min_s: float = 2.0, heartbeat_s: float = 1.0, max_restarts: int = 1) -> None:
    proc.lines.clear()
    proc._seq = 0
    env = {"TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_RESTART_COUNT": str(proc.attempt)}
    proc.instant(schema.INSTANT_PROCESS_START, env=env, settings={
        "watchdog": True, "heartbeat_s": heartbeat_s, "stall_min_s": stall_min_s, "stall_factor": 5.0})


def _pair(n: int = 2, host: str = "node0") -> list[Proc]:
    procs = [Proc(rank=r, world_size=n, host=host) for r in range(n)]
    for p in procs:
        _settings(p)
        p.steps(range(8))
    return procs


def test_live_hang_after_the_threshold_names_the_culprit_then_resolves(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs)
    assert g.poll_at(0.1) == []
    procs[1].stop_inside(8, [FORWARD])
    procs[0].stop_inside(8, [BACKWARD])
    assert g.poll_at(1.0) == []  # below stall_min_s: nothing yet
    since = procs[1].t0 + (procs[1].now_ms - 1) / 1000
    procs[1].advance(2100)
    _stall(procs[1], FORWARD, 2.1)  # its watchdog: past max(2 s, 5 × p99 forward) = 2 s
    events = g.poll_at(0.3)  # and the group closed no span for max(2 s, 5 × p99 step ≈ 0.4 s)
    assert [(e["type"], e["finding"]["kind"], e["finding"]["rank"], e["finding"]["phase"]) for e in events] == [
        ("finding", "hang", 1, FORWARD)]
    f = events[0]["finding"]
    assert f["victims"] == [0] and f["since"] == pytest.approx(since) and "stacks" not in f
    # The live table tells the culprit from its victims (every rank of a hung run is stalled).
    assert [row["state"] for row in g.live.rows(g.now)] == ["waiting on 1", "culprit"]
    assert g.poll_at(5.0) == []  # raised once
    procs[1].advance(10)
    procs[1].end()  # forward returns after all
    resolved = g.poll_at(0.1)
    assert [(e["type"], e["finding"]["rank"]) for e in resolved] == [("resolved", 1)]
    assert "culprit" not in [row["state"] for row in g.live.rows(g.now)]


def _in_a_checkpoint(p: Proc, seconds: int) -> None:
    """Step 8 begins and ``p`` stays ``seconds`` in its checkpoint, with the watchdog's heartbeats (quiet,
    not silent). No history yet: the checkpoint's threshold is stall_min_s × stall_factor = 10 s."""
    p.set_step(8)
    p.start("step")
    p.start(CHECKPOINT)
    for _ in range(seconds):
        p.advance(1000)
        p.instant(schema.INSTANT_HEARTBEAT, open=[{"tid": 1, "spans": ["step", CHECKPOINT]}])


def test_legitimately_slow_checkpoint_is_no_hang(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs)
    for p in procs:
        _in_a_checkpoint(p, 8)
    assert g.poll_at(0.0) == []
    assert [lp.status(g.now) for lp in g.live.procs.values()] == ["running", "running"]
    # Past the checkpoint's own threshold (their watchdogs say so) it is a hang after all: both ranks
    # alike, no culprit to name.
    for p in procs:
        p.advance(2100)
        _stall(p, CHECKPOINT, 10.1)
    assert g.poll_at(0.1) == []  # a hang naming no rank waits UNNAMED_HOLD_S for a culprit to show
    assert [(e["finding"]["kind"], e["finding"]["rank"]) for e in g.poll_at(0.2 + UNNAMED_HOLD_S)] == [("hang", None)]


def test_a_step_after_its_long_checkpoint_is_stalled_once_innermost_for_stall_min_s(tmp_path: Path) -> None:
    """The watchdog's rule: a span open past its threshold is stalled once it has also been the
    innermost for stall_min_s (2 s here). A step whose 8 s checkpoint ended 1.5 s ago has been open
    9.5 s, past its threshold and the grace for its watchdog's record (2 s + 2 s), but is running; 2.5 s
    after the checkpoint, still in the step's own code, it is stalled."""
    procs = _pair()
    g = Growing(tmp_path, procs)
    for p in procs:
        _in_a_checkpoint(p, 8)
        p.end()  # the checkpoint; the step goes on
        p.advance(1500)
        p.instant(schema.INSTANT_HEARTBEAT, open=[{"tid": 1, "spans": ["step"]}])
    assert g.poll_at(0.0) == []
    assert [lp.status(g.now) for lp in g.live.procs.values()] == ["running", "running"]
    for p in procs:
        p.advance(1000)
        p.instant(schema.INSTANT_HEARTBEAT, open=[{"tid": 1, "spans": ["step"]}])
    g.poll_at(0.0)
    assert [lp.status(g.now) for lp in g.live.procs.values()] == ["stalled", "stalled"]


def test_a_stall_record_from_before_a_child_ran_is_over(tmp_path: Path) -> None:
    """A step its watchdog called stalled, which then ran a checkpoint to its end, moved on: its old
    stall record is not the new stall's. 1.2 s after the checkpoint (stall_min_s 1 s, threshold 1 s),
    open 2.4 s, within the 2 s grace for its watchdog's new record: still running, waiting for it."""
    procs = [Proc(rank=r, world_size=2, host="node0") for r in range(2)]
    for p in procs:
        _settings(p, stall_min_s=1.0)
        p.steps(range(8))
    g = Growing(tmp_path, procs)
    for p in procs:
        p.set_step(8)
        p.start("step")
        p.advance(1100)
        _stall(p, "step", 1.1)
        p.start(CHECKPOINT)
        p.advance(100)
        p.end()
        p.advance(1200)
        p.instant(schema.INSTANT_HEARTBEAT, open=[{"tid": 1, "spans": ["step"]}])
    assert g.poll_at(0.0) == []
    assert [lp.status(g.now) for lp in g.live.procs.values()] == ["running", "running"]
    assert all(lp.awaiting_stall_record(g.now) for lp in g.live.procs.values())


def test_process_gone_from_this_host_is_a_crash_at_once(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs)
    procs[1].stop_inside(8, ["optimizer"])
    procs[0].stop_inside(9, [FORWARD])
    assert g.poll_at(0.1) == []
    g.host.dead.add(procs[1].pid)
    events = g.poll_at(0.2)
    assert [(e["finding"]["kind"], e["finding"]["rank"], e["finding"]["phase"]) for e in events] == [
        ("crash", 1, "optimizer")]
    assert [row["state"] for row in g.live.rows(g.now)] == ["running", "dead"]


def test_remote_process_without_heartbeats_is_dead_after_three_periods(tmp_path: Path) -> None:
    procs = _pair(host="node9")  # not this host: only silence tells
    g = Growing(tmp_path, procs)
    procs[1].stop_inside(8, [FORWARD])
    procs[0].stop_inside(9, [FORWARD])
    assert g.poll_at(0.1) == []
    procs[0].advance(3400)
    procs[0].instant(schema.INSTANT_HEARTBEAT, open=[{"tid": 1, "spans": ["step", FORWARD]}])
    events = g.poll_at(0.1)  # rank 1 silent for 3.5 s > 3 × heartbeat_s; rank 0's heartbeat keeps it alive
    assert [(e["finding"]["kind"], e["finding"]["rank"]) for e in events] == [("crash", 1)]


def test_new_attempt_is_a_restart_and_watch_waits_for_it(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs)
    procs[1].fail(8, FORWARD)
    for p in procs:
        p.shutdown()
    events = g.poll_at(0.5)
    assert [(e["finding"]["kind"], e["finding"]["rank"]) for e in events] == [("error", 1)]
    assert not g.live.finished()  # an attempt failed and torchrun may restart it: wait for the next one
    later = [Proc(rank=r, attempt=1, stamp="20240101-000100", t0=procs[0].t0 + 5) for r in (0, 1)]
    for p in later:
        _settings(p)
        p.steps(range(8, 12))
    g.procs += later
    g.written.update({id(p): 0 for p in later})
    events = g.poll_at(0.1)
    assert [(e["finding"]["kind"], e["finding"]["attempt"]) for e in events] == [("restart", 1)]
    for p in later:
        p.shutdown()
    g.poll_at(0.1)
    assert g.live.finished()


def test_waits_for_a_run_that_has_not_started(tmp_path: Path) -> None:
    live = LiveRun(tmp_path / "not-yet", probe=FakeHost(), clock=lambda: 0.0)  # type: ignore[arg-type]
    assert live.poll() == [] and not live.finished() and live.rows() == []


def test_stacks_come_from_the_stall_record_when_asked(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs, stacks=True)
    procs[1].stop_inside(8, [FORWARD])
    procs[0].stop_inside(8, [BACKWARD])
    procs[1].advance(2100)
    _stall(procs[1], FORWARD, 2.1)
    (event,) = g.poll_at(0.3)
    assert [s["tid"] for s in event["finding"]["stacks"]] == [1, 7]


def test_a_late_watchdog_gets_a_grace_then_the_same_rule_decides(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs)
    procs[1].stop_inside(8, [FORWARD])
    procs[0].stop_inside(8, [BACKWARD])
    for _ in range(3):  # heartbeats, but no stall record
        for p in procs:
            p.advance(1000)
            p.instant(schema.INSTANT_HEARTBEAT, open=[])
    assert g.poll_at(0.0) == []  # 3 s: past the 2 s threshold, within the 2 s grace
    for p in procs:
        p.advance(1500)
        p.instant(schema.INSTANT_HEARTBEAT, open=[])
    assert [(e["finding"]["kind"], e["finding"]["rank"]) for e in g.poll_at(0.1)] == [("hang", 1)]


def test_silent_process_on_this_host_is_judged_without_waiting_for_its_watchdog(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs)
    procs[1].stop_inside(8, [FORWARD])  # holds the GIL: no heartbeat, no stall record
    procs[0].stop_inside(8, [BACKWARD])
    for _ in range(3):
        procs[0].advance(1000)
        procs[0].instant(schema.INSTANT_HEARTBEAT, open=[])
    events = g.poll_at(0.1)
    assert [(e["finding"]["kind"], e["finding"]["rank"]) for e in events] == [("hang", 1)]
    assert [row["state"] for row in g.live.rows(g.now)] == ["waiting on 1", "culprit (silent)"]


def test_no_restart_expected_means_the_end_comes_at_once(tmp_path: Path) -> None:
    procs = [Proc(rank=r) for r in (0, 1)]
    for p in procs:
        _settings(p, max_restarts=0)
        p.steps(range(3))
    procs[1].fail(3, FORWARD)
    for p in procs:
        p.shutdown()
    g = Growing(tmp_path, procs)
    assert [e["finding"]["kind"] for e in g.poll_at(0.1)] == ["error"]
    assert g.live.finished()


def test_export_shows_stall_records_as_instants_with_their_stacks(tmp_path: Path) -> None:
    from otel_train.analysis.export import export

    write_run(tmp_path, _hung_pair())
    trace = json.loads(export(tmp_path, "chrome").output.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    (stall,) = [e for e in events if e.get("name") == schema.INSTANT_STALL]
    assert stall["ph"] == "i" and stall["args"]["span"] == FORWARD and stall["args"]["step"] == 6
    assert [s["frames"] for s in stall["args"]["stacks"]][1] == STACK


def test_straggler_over_the_recent_steps_is_raised_then_resolved(tmp_path: Path) -> None:
    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    for p in procs:
        _settings(p)
        slow = {"data_fetch": 30.0 if p.rank == 1 else 5.0, FORWARD: 20.0, BACKWARD: 40.0}
        p.steps(range(30), slow)
    g = Growing(tmp_path, procs)
    events = g.poll_at(0.1)
    # Unsynchronised synthetic ranks: rank 1's whole step is slow too (no peer waits for it here).
    assert {(e["type"], e["finding"]["kind"], e["finding"]["rank"], e["finding"]["phase"]) for e in events} == {
        ("finding", "straggler", 1, "data_fetch"), ("finding", "straggler", 1, "step")}
    for p in procs:
        p.steps(range(30, 90), {"data_fetch": 5.0, FORWARD: 20.0, BACKWARD: 40.0})
    assert g.poll_at(0.1) == []  # the rule is asked again only after STRAGGLERS_EVERY_S
    events = g.poll_at(31.0)  # over the last 50 steps rank 1 is like its peers
    assert sorted((e["type"], e["finding"]["rank"], e["finding"]["phase"]) for e in events) == [
        ("resolved", 1, "data_fetch"), ("resolved", 1, "step")]


def test_with_stacks_a_hang_waits_briefly_for_the_culprits_own_stall_record(tmp_path: Path) -> None:
    procs = _pair()
    g = Growing(tmp_path, procs, stacks=True)
    procs[1].stop_inside(8, [FORWARD])
    procs[0].stop_inside(8, [BACKWARD])
    procs[0].advance(2100)
    _stall(procs[0], BACKWARD, 2.1)  # the victim's watchdog looked first
    procs[1].advance(2000)
    procs[1].instant(schema.INSTANT_HEARTBEAT, open=[])
    assert g.poll_at(0.2) == []  # the group is hung, but the culprit's stacks are due within a second
    procs[1].advance(300)
    _stall(procs[1], FORWARD, 2.3)
    (event,) = g.poll_at(0.1)
    assert (event["finding"]["rank"], event["finding"]["stacks"][0]["tid"]) == (1, 1)


def test_the_straggler_rule_runs_beside_reading_and_its_answer_comes_later(tmp_path: Path) -> None:
    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    for p in procs:
        _settings(p)
        p.steps(range(30), {"data_fetch": 30.0 if p.rank == 1 else 5.0, FORWARD: 20.0, BACKWARD: 40.0})
    write_run(tmp_path, procs)
    live = LiveRun(tmp_path, probe=FakeHost(host="elsewhere"), clock=lambda: procs[0].t0 + 10)  # type: ignore[arg-type]
    found: list[dict] = []
    deadline = time.monotonic() + 20
    while not found and time.monotonic() < deadline:
        found = [e["finding"] for e in live.poll() if e["finding"]["kind"] == "straggler"]
        time.sleep(0.05)
    live.close()
    assert {(f["rank"], f["phase"]) for f in found} >= {(1, "data_fetch")}


def test_host_probe_tells_live_zombie_gone_and_reused_pids() -> None:
    import subprocess
    import sys

    from otel_train.analysis.live import HostProbe

    probe = HostProbe()
    me = os.getpid()
    assert probe.alive(me) and probe.alive(me, since=time.time())
    assert not probe.alive(me, since=time.time() - 10 * 365 * 86400)  # this pid's process began later: reused
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while probe.alive(child.pid) and time.monotonic() < deadline:  # exited, not yet reaped: a zombie
        time.sleep(0.05)
    assert not probe.alive(child.pid)
    child.wait()
    assert not probe.alive(child.pid)
