"""Comm findings live (docs/watch.md): files that grow record by record, read by a LiveRun on a fake
clock; the same hang (with its ``comm``) as summarize, a desync as soon as both sides are read, and
``otel-train watch --json`` on a real growing run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from analysis_fixtures import Proc
from comm_sim import declare, dp_steps, open_op
from test_watch_live import Growing, _settings

from otel_train import schema
from otel_train.analysis.comm import SOURCE_FR, CommOp, Group
from otel_train.analysis.live import UNNAMED_HOLD_S
from otel_train.analysis.summary import summarize
from otel_train.phases import BACKWARD, DATA_FETCH, STEP


def _dp(n: int = 4, steps: int = 8) -> list[Proc]:
    procs = [Proc(rank=r, world_size=n) for r in range(n)]
    for p in procs:
        _settings(p)
    declare(procs)
    dp_steps(procs, range(steps))
    return procs


def _hang_at(procs: list[Proc], step: int, culprit: int, seq: int) -> None:
    for p in procs:
        p.set_step(step)
        p.start(STEP)
        p.start(DATA_FETCH)
        if p.rank == culprit:
            continue
        p.advance(5)
        p.end()
        p.start(BACKWARD)
        open_op(p, "all_reduce", "0", seq)


def test_live_hang_names_the_op_like_summarize(tmp_path: Path) -> None:
    procs = _dp()
    g = Growing(tmp_path, procs)
    assert g.poll_at(0.1) == []
    _hang_at(procs, 8, culprit=2, seq=8)
    assert g.poll_at(1.0) == []  # below stall_min_s (2 s)
    events = g.poll_at(4.5)  # past the threshold and the grace its watchdog gets to write a stall record
    assert [(e["type"], e["finding"]["kind"], e["finding"]["rank"]) for e in events] == [("finding", "hang", 2)]
    live = events[0]["finding"]
    assert live["comm"] == {"group": "0", "seq": 8, "op": "all_reduce", "waiting": [0, 1, 3], "missing": [2],
                            "ops": {"0": "all_reduce", "1": "all_reduce", "3": "all_reduce"}}
    assert live["victims"] == [0, 1, 3] and live["phase"] == DATA_FETCH
    after = [f for f in summarize(tmp_path)["findings"] if f["kind"] == "hang"]
    assert after[0]["comm"] == live["comm"] and after[0]["message"] == live["message"]
    assert g.poll_at(5.0) == []  # raised once


def test_live_desync_is_raised_as_soon_as_both_sides_are_read(tmp_path: Path) -> None:
    procs = _dp(2)
    g = Growing(tmp_path, procs)
    assert g.poll_at(0.1) == []
    for p in procs:
        p.set_step(8)
        p.start(STEP)
    open_op(procs[0], "all_reduce", "0", 8)
    assert g.poll_at(0.01) == []  # one side only
    open_op(procs[1], "broadcast", "0", 8)
    events = g.poll_at(0.01)  # well before any hang threshold
    assert [(e["finding"]["kind"], e["finding"]["rank"]) for e in events] == [("desync", 1)]
    assert events[0]["finding"]["comm"]["ops"] == {"0": "all_reduce", "1": "broadcast"}
    assert g.poll_at(3.0) == []  # the desync explains the hang: no second finding


def test_live_arrival_straggler_over_the_recent_steps(tmp_path: Path) -> None:
    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    for p in procs:
        _settings(p)
    declare(procs)

    def times(r: int, s: int) -> dict[str, float]:
        return {DATA_FETCH: 45.0 if r == 3 else 5.0, "forward": 20.0, BACKWARD: 30.0, "optimizer": 5.0, "tail": 2.0}

    dp_steps(procs, range(30), times)
    for p in procs:
        p.shutdown()
    g = Growing(tmp_path, procs)
    events = g.poll_at(0.1)
    found = [e["finding"] for e in events if e["type"] == "finding"]
    assert [(f["kind"], f["rank"], f["phase"]) for f in found] == [("straggler", 3, DATA_FETCH)]
    assert found[0]["arrival"]["last_at"] == 30 and found[0]["comm"]["waiting"] == [0, 1, 2]


def test_live_dumps_are_read_and_merged(tmp_path: Path) -> None:
    # Rank 2's trace says nothing of all_reduce #8; its dump says it waits in it too: nobody is missing.
    procs = _dp()
    fr = tmp_path / "flight_recorder"
    fr.mkdir()
    (fr / "rank_2.json").write_text("{}")
    reads = []

    def read(path: Path) -> tuple[list[CommOp], list[Group]]:
        reads.append(path)
        return [CommOp(2, 0, "0", 8, "all_reduce", None, None, state="started", source=SOURCE_FR)], []

    g = Growing(tmp_path, procs, fr=fr, read_fr=read)
    _hang_at(procs, 8, culprit=2, seq=8)
    assert g.poll_at(4.5) == []  # a hang that names no rank waits for the views to settle (UNNAMED_HOLD_S)
    assert reads == [fr]
    assert g.poll_at(4.5 + UNNAMED_HOLD_S - 0.5) == []
    events = g.poll_at(4.5 + UNNAMED_HOLD_S + 0.1)
    hangs = [e["finding"] for e in events if e["finding"]["kind"] == "hang"]
    assert hangs and hangs[0]["rank"] is None and hangs[0]["comm"]["missing"] == []


def test_watch_json_lines_carry_comm(tmp_path: Path) -> None:
    """The CLI on a run that grows while it watches: the hang line carries ``comm``; exit 3 on it."""
    me, host = os.getpid(), socket.gethostname()  # processes alive on this host
    procs = [Proc(rank=r, world_size=2, pid=me, host=host, t0=time.time() - 1.0) for r in range(2)]
    for p in procs:
        _settings(p, stall_min_s=1.0)
    declare(procs)
    dp_steps(procs, range(5))
    logs = tmp_path / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)

    def flush() -> None:
        for p in procs:
            (logs / p.file_name).write_text("".join(line + "\n" for line in p.lines))

    flush()
    cmd = [sys.executable, "-m", "otel_train.cli", "watch", str(tmp_path), "--json", "--exit-on", "hang",
           "--timeout", "60"]
    watcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        for p in procs:
            p.now_ms = (time.time() - p.t0) * 1000.0
        _hang_at(procs, 5, culprit=1, seq=5)
        flush()
        out, err = watcher.communicate(timeout=90)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    lines = [json.loads(line) for line in out.splitlines()]
    found = [ln["finding"] for ln in lines if ln["type"] == "finding"]
    assert watcher.returncode == 3, (out, err)
    assert [(f["kind"], f["rank"]) for f in found] == [("hang", 1)]
    assert found[0]["comm"] == {"group": "0", "seq": 5, "op": "all_reduce", "waiting": [0], "missing": [1],
                                "ops": {"0": "all_reduce"}}


def test_live_graph_keeps_only_what_it_needs(tmp_path: Path, monkeypatch) -> None:
    import otel_train.analysis.live.graphs as graphs_mod

    monkeypatch.setattr(graphs_mod, "PRUNE_EVERY_OPS", 100)
    procs = _dp(2, steps=200)
    g = Growing(tmp_path, procs)
    assert g.poll_at(0.1) == []
    graph = g.live.graphs[("training", 0)]
    assert len(graph.collectives) <= graphs_mod.RECENT_STEPS + 60  # of 200: old completed ones dropped
    assert graph.last_seq[(0, "0")] == 199
    _hang_at(procs, 200, culprit=1, seq=200)
    events = g.poll_at(4.5)
    assert [(e["finding"]["kind"], e["finding"]["rank"], e["finding"]["comm"]["seq"]) for e in events] == [("hang", 1, 200)]
