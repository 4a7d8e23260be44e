"""Collectives in the export: each rank's ``comm.*`` spans on a comm track of their own, flows through a
collective's members (in arrival order) and from each send to its recv, the last arrival marked, the
hang's culprit marked on its comm track, and ops only a Flight Recorder dump saw merged in
(docs/export.md, "Communication"). Runs are written with tests/analysis_fixtures.py (CONTRACT attrs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from analysis_fixtures import Proc, write_run
from otel_train import schema
from otel_train.analysis.export import export
from otel_train.analysis.validate import validate_chrome_trace

pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")

T0 = 1_700_000_000.0
LATE_MS = 5.0  # rank 2 arrives this much later at every all_reduce


def _group(p: Proc, group: str, desc: str, ranks: list[int]) -> None:
    p.instant(schema.INSTANT_COMM_GROUP, group=group, desc=desc, ranks=ranks)


def _comm(p: Proc, op: str, seq: int, ms: float, group: str = "0", peer: int | None = None, nbytes: int = 64) -> None:
    attrs: dict[str, Any] = {schema.ATTR_COMM_GROUP: group, schema.ATTR_COMM_SEQ: seq, schema.ATTR_COMM_BYTES: nbytes,
                             schema.ATTR_COMM_DTYPE: "float32", schema.ATTR_COMM_CLOCK: "host"}
    if peer is not None:
        attrs[schema.ATTR_COMM_PEER] = peer
    p.start(schema.comm_span_name(op), **attrs)
    p.advance(ms)
    p.end()


def hung_run(run: Path) -> Path:
    """3 ranks: two steps of forward, backward (an all_reduce of group 0 inside, rank 2 last), rank 0
    sends to rank 1; in step 2 ranks 0 and 1 wait in all_reduce #3 that rank 2 never issues."""
    procs = [Proc(rank=r, world_size=3, t0=T0) for r in range(3)]
    for p in procs:
        _group(p, "0", "default_pg", [0, 1, 2])
        for step in range(2):
            p.set_step(step)
            p.start("step")
            p.start("forward")
            p.advance(10.0)
            p.end()
            p.start("backward")
            p.advance(20.0 + (LATE_MS if p.rank == 2 else 0.0))
            arrive = 30.0 + LATE_MS + step * 100.0  # everybody leaves the all_reduce together
            _comm(p, "all_reduce", step + 1, max(arrive - p.now_ms, 0.5) if p.rank != 2 else 0.5)
            p.end()
            late = 2.0 * step  # step 1: rank 1 posts its recv before rank 0 sends (it waits 2 ms)
            if p.rank == 0:
                p.advance(late)
                _comm(p, "send", step + 1, 1.0, peer=1)
            elif p.rank == 1:
                _comm(p, "recv", step + 1, 1.0 + late, peer=0)
            else:
                p.advance(1.0)
            p.advance(100.0 * (step + 1) - p.now_ms)
            p.end()
        p.set_step(2)
        p.start("step")
        p.start("forward")
        p.advance(5.0)
        if p.rank == 2:  # stops inside forward: never issues all_reduce #3
            continue
        p.end()
        p.start("backward")
        p.advance(5.0)
        p.start(schema.comm_span_name("all_reduce"), **{schema.ATTR_COMM_GROUP: "0", schema.ATTR_COMM_SEQ: 3,
                                                        schema.ATTR_COMM_BYTES: 64, schema.ATTR_COMM_DTYPE: "float32"})
        p.advance(200.0)
        p.instant(schema.INSTANT_HEARTBEAT)
    write_run(run, procs)
    return run


def _chrome(run: Path, tmp: Path, **kw: Any) -> tuple[Any, dict]:
    result = export(run, "chrome", tmp / "t.json", **kw)
    data = json.loads(result.output.read_text())
    assert validate_chrome_trace(data) == []
    return result, data


def _threads(data: dict) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def _procs(data: dict) -> dict[int, int]:
    """pid -> rank."""
    return {e["pid"]: int(e["args"]["name"].split()[1]) for e in data["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def test_chrome_comm_track_flows_last_arrival_culprit(tmp_path: Path) -> None:
    run = hung_run(tmp_path / "run")
    result, data = _chrome(run, tmp_path)
    threads, procs = _threads(data), _procs(data)
    comm = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"].startswith("comm.")]
    assert len(comm) == 3 * 2 + 2 * 2 + 2  # all_reduces, send/recv, the two open all_reduce #3
    assert {threads[(e["pid"], e["tid"])] for e in comm} == {"comm"}  # each rank's comm spans: their own track
    phases = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"] in ("forward", "backward")]
    assert all(threads[(e["pid"], e["tid"])] != "comm" for e in phases)
    assert sum(1 for (pid, _), name in threads.items() if name == "comm") == 3  # one per rank

    by_flow: dict[str, list[dict]] = {}
    for e in comm:
        if "bind_id" in e:
            by_flow.setdefault(e["bind_id"], []).append(e)
    # all_reduce #1, #2 through 3 ranks, #3 through the 2 waiting ranks, 2 send -> recv: 2+2+1+1+1
    assert result.flows == 7 and len(by_flow) == 5
    for events in by_flow.values():
        events.sort(key=lambda e: e["ts"])
        assert events[0].get("flow_out") and not events[0].get("flow_in")
        assert events[-1].get("flow_in") and not events[-1].get("flow_out")
        assert all(e.get("flow_in") and e.get("flow_out") for e in events[1:-1])
        assert len({e["pid"] for e in events}) == len(events)  # one span per rank
    pairs = [f for f in by_flow.values() if {e["name"] for e in f} == {"comm.send", "comm.recv"}]
    assert len(pairs) == 2 and all(len(f) == 2 for f in pairs)
    assert all({procs[e["pid"]]: e["name"] for e in f} == {0: "comm.send", 1: "comm.recv"} for f in pairs)
    # the flow runs in time order: a recv posted before its send starts it
    assert sorted([e["name"] for e in f] for f in pairs) == [["comm.recv", "comm.send"], ["comm.send", "comm.recv"]]

    last = [e for e in comm if e["args"].get("last_arrival")]
    assert sorted((procs[e["pid"]], e["args"][schema.ATTR_COMM_SEQ]) for e in last) == [(2, 1), (2, 2)]

    culprits = [e for e in data["traceEvents"] if e["ph"] == "i" and e["name"] == "culprit"]
    assert len(culprits) == 1
    mark = culprits[0]
    assert procs[mark["pid"]] == 2 and threads[(mark["pid"], mark["tid"])] == "comm"
    assert (mark["args"]["kind"], mark["args"]["group"], mark["args"]["seq"], mark["args"]["op"]) == (
        "hang", "0", 3, "all_reduce")
    assert mark["args"]["waiting"] == [0, 1]


def _perfetto(run: Path, tmp: Path, **kw: Any) -> tuple[Any, Any]:
    result = export(run, "perfetto", tmp / "t.pftrace", **kw)
    trace = pb.Trace()
    trace.ParseFromString(result.output.read_bytes())
    return result, trace


def test_perfetto_flow_ids_and_marks(tmp_path: Path) -> None:
    run = hung_run(tmp_path / "run")
    result, trace = _perfetto(run, tmp_path)
    names: dict[tuple[int, int], str] = {}
    tracks: dict[int, str] = {}
    for packet in trace.packet:
        if packet.HasField("track_descriptor") and packet.track_descriptor.HasField("thread"):
            tracks[packet.track_descriptor.uuid] = packet.track_descriptor.thread.thread_name
        for entry in packet.interned_data.event_names:
            names[(packet.trusted_packet_sequence_id, entry.iid)] = entry.name
    begins = []
    for packet in trace.packet:
        ev = packet.track_event
        if packet.HasField("track_event") and ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            begins.append((names[(packet.trusted_packet_sequence_id, ev.name_iid)], tracks[ev.track_uuid], ev,
                           (packet.timestamp, packet.trusted_packet_sequence_id)))
    comm = [(n, t, ev, ts) for n, t, ev, ts in begins if n.startswith("comm.")]
    assert comm and {t for _, t, _, _ in comm} == {"comm"}
    flows: dict[int, list[tuple[tuple[int, int], str]]] = {}  # by (time, process): the order a tie is read in
    for _, _, ev, ts in comm:
        for f in ev.flow_ids:
            flows.setdefault(f, []).append((ts, "step"))
        for f in ev.terminating_flow_ids:
            flows.setdefault(f, []).append((ts, "end"))
    assert len(flows) == 5
    arrows = 0
    for events in flows.values():
        events.sort()
        assert [k for _, k in events][-1] == "end" and all(k == "step" for _, k in events[:-1])
        arrows += len(events) - 1
    assert arrows == result.flows == 7
    last = [ev for _, _, ev, _ in comm if any(a.name == "last_arrival" and a.bool_value for a in ev.debug_annotations)]
    assert len(last) == 2
    instants = [packet for packet in trace.packet if packet.HasField("track_event")
                and packet.track_event.type == pb.TrackEvent.TYPE_INSTANT
                and names[(packet.trusted_packet_sequence_id, packet.track_event.name_iid)] == "culprit"]
    assert len(instants) == 1 and tracks[instants[0].track_event.track_uuid] == "comm"


def _dump(rank: int, entries: list[tuple[str, str, int, float, bool]]) -> dict:
    """A dump in Flight Recorder's JSON layout (see tests/data/fr for real ones): entries of
    (group, op, seq, ms since T0, completed)."""
    rows = []
    for i, (group, op, seq, ms, done) in enumerate(entries):
        rows.append({"record_id": i, "pg_id": int(group), "process_group": [group, "default_pg" if group == "0" else "ddp"],
                     "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{op}",
                     "time_created_ns": int((T0 + ms / 1000.0) * 1e9), "input_sizes": [[16]],
                     "input_dtypes": ["Float"], "output_sizes": [[16]], "output_dtypes": ["Float"],
                     "state": "scheduled", "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0,
                     "retired": done, "is_p2p": False})
    return {"version": "2.10", "pg_config": {"": {"desc": "", "name": "", "ranks": "[]"}}, "pg_status": {},
            "entries": rows}


def test_fr_dump_ops_merged_into_the_export(tmp_path: Path) -> None:
    """The dumps saw every all_reduce of group 0 (merged with the trace's: no second span) and the DDP
    reducer's all_reduces of group 1 that the trace never did: those appear as spans of their own,
    with flows; rank 2's dump is missing (named, not fatal)."""
    run = hung_run(tmp_path / "run")
    fr = run / "flight_recorder"
    fr.mkdir()
    for rank in (0, 1):
        entries = [("0", "all_reduce", 1, 30.0, True), ("0", "all_reduce", 2, 130.0, True),
                   ("1", "all_reduce", 1, 25.0 + rank, True), ("1", "all_reduce", 2, 125.0 + rank, True),
                   ("0", "all_reduce", 3, 211.0, False)]
        (fr / f"fr_trace_rank_{rank}.json").write_text(json.dumps(_dump(rank, entries)))
    warnings: list[str] = []
    from otel_train.analysis.records import Reader

    result, data = _chrome(run, tmp_path, reader=Reader(warn=warnings.append))
    assert result.dump_ops == 10
    comm = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"].startswith("comm.")]
    dump_only = [e for e in comm if e["args"].get("source") == "flight_recorder"]
    assert len(comm) == 12 + 4 and len(dump_only) == 4  # the trace's 12, the reducer's 4 from the dumps
    assert {e["args"][schema.ATTR_COMM_GROUP] for e in dump_only} == {"1"}
    threads = _threads(data)
    assert {threads[(e["pid"], e["tid"])] for e in dump_only} == {"comm"}
    assert result.flows == 7 + 2  # each reducer all_reduce joins ranks 0 and 1
    assert any("no dump for rank 2" in w for w in warnings)
    # --fr elsewhere; a path without dumps changes nothing
    result2, _ = _chrome(run, tmp_path, fr=tmp_path / "none")
    assert result2.dump_ops == 0 and result2.flows == 7


def test_run_without_comm_has_no_comm_track(tmp_path: Path) -> None:
    procs = [Proc(rank=r, t0=T0) for r in range(2)]
    for p in procs:
        p.steps(range(2))
        p.shutdown()
    write_run(tmp_path / "run", procs)
    result, data = _chrome(tmp_path / "run", tmp_path)
    assert result.flows == 0 and "comm" not in _threads(data).values()
    assert not any("bind_id" in e for e in data["traceEvents"])


def test_cli_export_fr(tmp_path: Path) -> None:
    """``otel-train export --fr PATH``: real dumps (tests/data/fr) merged, a garbage file skipped with one
    line, a missing ``--fr`` path a warning, never a traceback."""
    import shutil
    import subprocess
    import sys

    run = hung_run(tmp_path / "run")
    fr = tmp_path / "dumps"
    shutil.copytree(Path(__file__).parent / "data" / "fr" / "later", fr)
    (fr / "rank_2.json").write_text("{ torn")
    cli = [sys.executable, "-m", "otel_train.cli"]
    out = tmp_path / "t.json"
    proc = subprocess.run([*cli, "export", str(run), "--fr", str(fr), "-o", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ops from Flight Recorder dumps" in proc.stdout and "Traceback" not in proc.stderr
    assert sum("rank_2.json" in line for line in proc.stderr.splitlines()) == 1
    data = json.loads(out.read_text())
    assert any(e.get("args", {}).get("source") == "flight_recorder" for e in data["traceEvents"])
    proc = subprocess.run([*cli, "export", str(run), "--fr", str(tmp_path / "nope"), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--fr" in proc.stderr and "Traceback" not in proc.stderr


def test_desync_culprit_marked(tmp_path: Path) -> None:
    """Rank 1 calls broadcast where ranks 0 and 2 call all_reduce at seq 1: the culprit instant is on
    rank 1's comm track, naming each side."""
    procs = [Proc(rank=r, world_size=3, t0=T0) for r in range(3)]
    for p in procs:
        _group(p, "0", "default_pg", [0, 1, 2])
        p.set_step(0)
        p.start("step")
        p.advance(1.0)
        _comm(p, "broadcast" if p.rank == 1 else "all_reduce", 1, 2.0)
        p.end()
        p.shutdown()
    write_run(tmp_path / "run", procs)
    _, data = _chrome(tmp_path / "run", tmp_path)
    marks = [e for e in data["traceEvents"] if e["ph"] == "i" and e["name"] == "culprit"]
    assert [(_procs(data)[e["pid"]], e["args"]["kind"], e["args"]["seq"]) for e in marks] == [(1, "desync", 1)]
    assert _threads(data)[(marks[0]["pid"], marks[0]["tid"])] == "comm"
    assert "broadcast" in marks[0]["args"]["message"] and "all_reduce" in marks[0]["args"]["message"]


@pytest.mark.parametrize("fmt,cache", [("chrome", True), ("perfetto", True), ("chrome", False)])
def test_pool_renders_the_same_marks(fmt: str, cache: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marks travel with each process's task: a pool's output is byte for byte the serial one.
    Without the read cache the comm records are also searched by the pool (``_scanned``)."""
    import otel_train.analysis.export as export_package

    run = hung_run(tmp_path / "run")
    serial = export(run, fmt, tmp_path / "serial", workers=1, cache=cache)
    monkeypatch.setattr(export_package, "PARALLEL_MIN_BYTES", 0)
    pools: list[int] = []

    class Counted(export_package.ProcessPoolExecutor):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pools.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(export_package, "ProcessPoolExecutor", Counted)
    pooled = export(run, fmt, tmp_path / "pooled", workers=2, cache=cache)
    assert len(pools) == (1 if cache else 2)  # the rendering's pool; without the cache, the search's first
    assert serial.flows == pooled.flows == 7
    assert serial.output.read_bytes() == pooled.output.read_bytes()


REAL_JOB = '''
import os, sys
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
import torch, torch.distributed as dist
import otel_train as ot
run = sys.argv[1]
ot.init(enabled=True, save_path=run)
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(3):
    with ot.training_step(step):
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
os.makedirs(os.path.join(run, "flight_recorder"), exist_ok=True)
with open(os.path.join(run, "flight_recorder", f"rank_{rank}.pkl"), "wb") as f:
    f.write(torch._C._distributed_c10d._dump_fr_trace())
dist.destroy_process_group()
ot.shutdown()
'''


@pytest.mark.timeout(240)
def test_real_gloo_job_trace_and_dump_agree(tmp_path: Path) -> None:
    """A real 2-rank gloo torchrun job records its comm spans and dumps Flight Recorder in process: every
    dump op is the trace's op (same group and seq: merged, no span of its own), and the export draws a
    flow per collective and per send -> recv."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(REAL_JOB)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(run)], env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    result, data = _chrome(run, tmp_path)
    assert result.dump_ops == 2 * 6  # gloo's Flight Recorder: the collectives, not send/recv
    comm = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"].startswith("comm.")]
    assert [e for e in comm if e["args"].get("source") == "flight_recorder"] == []
    assert len(comm) == 2 * 3 * 3
    assert result.flows == 3 * 2 + 3  # all_reduce and broadcast of each step across 2 ranks, each send -> recv
    assert {_threads(data)[(e["pid"], e["tid"])] for e in comm} == {"comm"}


def test_dumps_found_in_the_runs_fr_dir(tmp_path: Path) -> None:
    """Without ``fr``, the dumps are read from the ``fr_dir`` the processes recorded in ``process_start``."""
    run = tmp_path / "run"
    elsewhere = tmp_path / "dumps_elsewhere"
    elsewhere.mkdir()
    procs = [Proc(rank=r, world_size=2, t0=T0) for r in range(2)]
    for p in procs:
        p.instant(schema.INSTANT_PROCESS_START, settings={"fr_dir": str(elsewhere)})
        p.steps(range(1))
        p.shutdown()
    write_run(run, procs)
    for rank in (0, 1):
        (elsewhere / f"rank_{rank}.json").write_text(json.dumps(_dump(rank, [("1", "all_reduce", 1, 3.0, True)])))
    result, data = _chrome(run, tmp_path)
    assert result.dump_ops == 2 and result.flows == 1
    assert sum(1 for e in data["traceEvents"] if e["ph"] == "X" and e["args"].get("source") == "flight_recorder") == 2
