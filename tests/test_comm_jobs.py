"""Real ``torchrun`` jobs (gloo on CPU, 2-4 ranks): every rank's file holds the ``comm.*`` spans of every
op it issued, consistent across the members of each group (docs/comm.md, "Recording").

DDP (reducer all-reduces through the comm hook, setup ops from the Flight Recorder buffer), FSDP2
(all_gather / reduce_scatter from Python), tensor parallel (DTensor's functional collectives, from the
buffer only) and pipeline parallel (2 stages x 2 data-parallel: send/recv per microbatch, the dp
all-reduce), then a hung job read while it hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from otel_train import phases, schema as S
from otel_train.analysis.records import Reader, find_process_files

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
Records = dict[int, list[dict[str, Any]]]


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR", "TORCH_NCCL"))}
    env.update(OMP_NUM_THREADS="1", OTEL_TRAIN_HEARTBEAT_S="0")
    return env


def torchrun_cmd(script: str, save: Path, nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(EXAMPLES / script), "--save-path", str(save), *args]


def run_job(script: str, save: Path, nproc: int, *args: str) -> Records:
    done = subprocess.run(torchrun_cmd(script, save, nproc, *args), cwd=save.parent, env=job_env(),
                          capture_output=True, text=True, timeout=240, start_new_session=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return by_rank(save)


def by_rank(save: Path) -> Records:
    reader = Reader()
    out = {pf.rank: list(reader.records(pf)) for pf in find_process_files(save)}
    assert reader.malformed_lines == 0
    return out


def comm_spans(recs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    ends = {r["span_id"]: r for r in recs if r["kind"] == S.SPAN_END}
    return [(r, ends.get(r["span_id"])) for r in recs
            if r["kind"] == S.SPAN_START and S.comm_op_of(r["name"]) is not None]


def op_attrs(start: dict[str, Any], end: dict[str, Any] | None) -> dict[str, Any]:
    """An op's attrs as readers take them, the end's over the start's: a recv from any source learns its
    peer and per-peer seq when it returns, and its start record, written before the op is handed to the
    backend, has neither (docs/comm.md, "Limits")."""
    return {**start["attrs"], **((end or {}).get("attrs") or {})}


def parents(recs: list[dict[str, Any]]) -> dict[str, str]:
    return {r["span_id"]: r["name"] for r in recs if r["kind"] == S.SPAN_START}


def check_comm(runs: Records, world: int) -> dict[tuple[str, int], dict[int, tuple[str, int, str | None]]]:
    """What every job must show; returns (group, seq) -> rank -> (op, bytes, dtype) of the collectives."""
    assert sorted(runs) == list(range(world))
    collectives: dict[tuple[str, int], dict[int, tuple[str, int, str | None]]] = defaultdict(dict)
    groups: dict[str, list[int]] = {}
    for rank, recs in runs.items():
        spans = comm_spans(recs)
        assert spans, f"rank {rank} recorded no comm op"
        announced = {}
        for r in recs:
            if r["name"] == S.INSTANT_COMM_GROUP and r["kind"] == S.INSTANT:
                attrs = r["attrs"]
                assert attrs["group"] not in announced, "one comm.group instant per group and process"
                assert rank in attrs["ranks"] and isinstance(attrs["desc"], str) and attrs["desc"]
                assert groups.setdefault(attrs["group"], attrs["ranks"]) == attrs["ranks"]  # same on every member
                announced[attrs["group"]] = r["seq"]
        seen = set()
        for start, end in spans:
            op = S.comm_op_of(start["name"])
            assert op not in S.P2P_OPS or S.ATTR_COMM_PEER in start["attrs"] or op == "recv", (rank, start)
            attrs = op_attrs(start, end)
            assert op in S.COMM_OPS
            group, seq = attrs[S.ATTR_COMM_GROUP], attrs[S.ATTR_COMM_SEQ]
            assert isinstance(group, str) and isinstance(seq, int) and seq >= 1
            assert isinstance(attrs[S.ATTR_COMM_BYTES], int) and attrs[S.ATTR_COMM_CLOCK] == S.COMM_CLOCK_HOST
            assert op == "barrier" or isinstance(attrs[S.ATTR_COMM_DTYPE], str)
            assert announced[group] < start["seq"], "the group is described before its first op"
            assert end is not None and end["status"] == S.STATUS_OK, (rank, start["name"], end)
            key = (group, seq, attrs.get(S.ATTR_COMM_PEER), op if op in S.P2P_OPS else "collective")
            assert key not in seen, f"rank {rank}: {key} recorded twice"
            seen.add(key)
            if op in S.P2P_OPS:
                assert isinstance(attrs[S.ATTR_COMM_PEER], int) and attrs[S.ATTR_COMM_PEER] in groups[group]
            else:
                collectives[(group, seq)][rank] = (op, attrs[S.ATTR_COMM_BYTES], attrs.get(S.ATTR_COMM_DTYPE))
    for (group, seq), members in collectives.items():
        assert sorted(members) == sorted(groups[group]), f"{group}#{seq} not on every member: {members}"
        assert len(set(members.values())) == 1, f"{group}#{seq} differs between members: {members}"
    return collectives


def check_p2p(runs: Records) -> int:
    """The k-th send A→B in a group and the k-th recv on B from A carry the same bytes; returns the pairs."""
    sends, recvs = {}, {}
    for rank, recs in runs.items():
        for start, end in comm_spans(recs):
            attrs, op = op_attrs(start, end), S.comm_op_of(start["name"])
            if op in S.P2P_OPS:
                src, dst = (rank, attrs[S.ATTR_COMM_PEER]) if op == "send" else (attrs[S.ATTR_COMM_PEER], rank)
                (sends if op == "send" else recvs)[(attrs[S.ATTR_COMM_GROUP], src, dst, attrs[S.ATTR_COMM_SEQ])] = (
                    attrs[S.ATTR_COMM_BYTES], attrs[S.ATTR_COMM_DTYPE])
    assert sends and sends == recvs
    return len(sends)


def meshes(runs: Records) -> dict[int, dict[str, Any]]:
    out = {}
    for rank, recs in runs.items():
        found = [r["attrs"] for r in recs if r["name"] == S.INSTANT_MESH]
        assert len(found) == 1, (rank, found)
        out[rank] = found[0]
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Records:
    save = tmp_path_factory.mktemp("ddp") / "run"
    return run_job("train_ddp.py", save, 2, "--steps", "4", "--batch-size", "16", "--eval-every", "0",
                   "--checkpoint-every", "2", "--metrics")


def test_ddp_every_op_once_with_the_reducer_through_the_hook(ddp: Records) -> None:
    collectives = check_comm(ddp, 2)
    for rank, recs in ddp.items():
        names = parents(recs)
        spans = [s for s, _ in comm_spans(recs)]
        reducer = [s for s in spans if names.get(s.get("parent_span_id")) == phases.BACKWARD]
        assert [s["step"] for s in reducer] == [0, 1, 2, 3]  # one bucket, one all-reduce per step, no duplicate
        assert all(s["name"] == "comm.all_reduce" and "comm.source" not in s["attrs"] for s in reducer)
        metric = [s for s in spans if names.get(s.get("parent_span_id")) == phases.STEP]
        assert [s["attrs"][S.ATTR_COMM_SEQ] for s in metric] == [1, 2, 3, 4]  # the metrics group's own sequence
        assert [s["name"] for s in spans if names.get(s.get("parent_span_id")) == phases.CHECKPOINT] == ["comm.barrier"]
        setup = [s for s in spans if s["attrs"].get("comm.source") == "flight_recorder"]
        assert setup and {s["name"] for s in setup} <= {"comm.broadcast", "comm.all_gather"}  # DDP's, from C++
        descs = {r["attrs"]["desc"] for r in recs if r["name"] == S.INSTANT_COMM_GROUP}
        assert descs == {"default_pg", "metrics"}
    world_seqs = sorted(seq for group, seq in collectives if group == "0")
    assert world_seqs == list(range(1, len(world_seqs) + 1))  # gapless: nothing DDP issued is missing


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Records:
    return run_job("train_parallel.py", tmp_path_factory.mktemp("fsdp2") / "run", 2, "--mode", "fsdp2",
                   "--steps", "3")


def test_fsdp2_all_gathers_and_reduce_scatters(fsdp2: Records) -> None:
    collectives = check_comm(fsdp2, 2)
    ops = Counter(next(iter(members.values()))[0] for members in collectives.values())
    assert ops["all_gather"] >= 3 * 3 and ops["reduce_scatter"] >= 3 * 3  # 3 shards x 3 steps, each way
    for recs in fsdp2.values():
        names = parents(recs)
        under = Counter(names.get(s.get("parent_span_id")) for s, _ in comm_spans(recs))
        assert under[phases.FORWARD] >= 9 and under[phases.BACKWARD] >= 9
        assert meshes({0: recs})[0] == {"dims": {"dp": 2}, "coords": {"dp": recs[0]["rank"]}}


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> Records:
    return run_job("train_parallel.py", tmp_path_factory.mktemp("tp") / "run", 2, "--mode", "tp", "--steps", "3")


def test_tensor_parallel_functional_collectives_come_from_the_buffer(tp: Records) -> None:
    check_comm(tp, 2)
    for rank, recs in tp.items():
        from_buffer = [s for s, _ in comm_spans(recs) if s["attrs"].get("comm.source") == "flight_recorder"]
        assert len([s for s in from_buffer if s["name"] == "comm.all_reduce"]) == 3  # RowwiseParallel, each step
        assert sorted(s["step"] for s in from_buffer) == [0, 1, 2]  # each the step it was issued in
        setup = [s for s, _ in comm_spans(recs) if s["name"] in ("comm.scatter", "comm.broadcast")]
        assert setup and all("step" not in s for s in setup)  # parallelize_module's, before the first step
    assert meshes(tp) == {r: {"dims": {"tp": 2}, "coords": {"tp": r}} for r in (0, 1)}


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory) -> Records:
    return run_job("train_parallel.py", tmp_path_factory.mktemp("pp") / "run", 4, "--mode", "pp", "--steps", "3",
                   "--schedule", "1f1b")


def test_pipeline_sends_match_recvs_and_compute_spans_carry_the_microbatch(pp: Records) -> None:
    collectives = check_comm(pp, 4)
    assert check_p2p(pp) >= 2 * 3 * 4 * 2  # 2 pipelines x 3 steps x 4 microbatches, forward and backward
    coords = {rank: mesh["coords"] for rank, mesh in meshes(pp).items()}
    assert all(mesh["dims"] == {"pp": 2, "dp": 2} for mesh in meshes(pp).values())
    assert sorted((c["pp"], c["dp"]) for c in coords.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, recs in pp.items():
        descs = {r["attrs"]["group"]: r["attrs"]["desc"] for r in recs if r["name"] == S.INSTANT_COMM_GROUP}
        assert sorted(descs.values()) == ["default_pg", "dp", "pp"]  # every group it is in, ops or not
        for start, _ in comm_spans(recs):
            assert descs[start["attrs"][S.ATTR_COMM_GROUP]] == ("pp" if S.comm_op_of(start["name"]) in S.P2P_OPS
                                                                else "dp")
        compute = [r for r in recs if r["kind"] == S.SPAN_START and r["name"] in (phases.FORWARD, phases.BACKWARD)]
        by_step = defaultdict(set)
        for r in compute:
            by_step[(r["step"], r["name"])].add(r["attrs"][S.ATTR_MICROBATCH])
            assert r["attrs"]["stage"] == coords[rank]["pp"]
        assert by_step == {(step, name): {0, 1, 2, 3} for step in range(3) for name in (phases.FORWARD, phases.BACKWARD)}
    dp_ops = {next(iter(m.values()))[0] for (group, _), m in collectives.items()}
    assert dp_ops == {"all_reduce"}


def open_comm_spans(save: Path) -> dict[int, list[dict[str, Any]]]:
    """Per rank, the comm span starts without an end so far (the files as they are now)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in (save / S.STRUCTURED_LOGS_DIR).glob("*.jsonl"):
        recs = []
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        ended = {r["span_id"] for r in recs if r["kind"] == S.SPAN_END}
        if recs:
            out[recs[0]["rank"]] = [s for s, _ in comm_spans(recs) if s["span_id"] not in ended]
    return out


def test_a_rank_waiting_in_an_op_shows_an_open_comm_span_within_a_second(tmp_path: Path) -> None:
    # Rank 1 skips the metric all-reduce of step 3: rank 0 waits in it, rank 1 in step 4's DDP all-reduce.
    save = tmp_path / "run"
    cmd = torchrun_cmd("train_ddp.py", save, 2, "--steps", "8", "--batch-size", "16", "--eval-every", "0",
                       "--checkpoint-every", "0", "--fault", "skip-collective", "--fault-rank", "1",
                       "--fault-step", "3", "--timeout-s", "20")
    # A stall after 1 s (comm.all_reduce has past durations far below it): the watchdog dumps Flight Recorder.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**job_env(), "OTEL_TRAIN_STALL_MIN_S": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    seen: dict[int, tuple[dict[str, Any], float]] = {}
    dumps: dict[int, Path] = {}
    try:
        deadline = time.monotonic() + 120
        # The op each rank waits in for good: open, and still the same one 1.5 s after it was first seen
        # (on a loaded machine a poll also catches ops of step 3 that were open only for a moment).
        while time.monotonic() < deadline and proc.poll() is None:
            if (save / S.STRUCTURED_LOGS_DIR).exists():
                for rank, starts in open_comm_spans(save).items():
                    waiting = [s for s in starts if s.get("step", -1) >= 3]
                    if not waiting:
                        seen.pop(rank, None)
                        continue
                    latest = max(waiting, key=lambda r: r["ts"])  # the op it began waiting in last
                    if rank not in seen or seen[rank][0]["span_id"] != latest["span_id"]:
                        seen[rank] = (latest, time.time())
            if len(seen) == 2 and all(time.time() - at >= 1.5 for _, at in seen.values()):
                break
            time.sleep(0.05)
        alive = proc.poll() is None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(dumps) < 2 and proc.poll() is None:
            for path in (save / "flight_recorder").glob("stall.*.json"):
                dumps.setdefault(int(path.name.rsplit("rank_", 1)[1].split(".")[0]), path)
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert alive and sorted(seen) == [0, 1], (seen, proc.stderr.read()[-3000:] if proc.stderr else "")
    waiting0, seen_at0 = seen[0]
    waiting1, seen_at1 = seen[1]
    assert waiting0["name"] == "comm.all_reduce" and waiting0["step"] == 3
    assert waiting0["attrs"][S.ATTR_COMM_SEQ] == 4 and waiting0["attrs"][S.ATTR_COMM_BYTES] == 16  # metrics #4
    assert waiting1["name"] == "comm.all_reduce" and waiting1["step"] == 4
    assert waiting1["attrs"][S.ATTR_COMM_GROUP] != waiting0["attrs"][S.ATTR_COMM_GROUP]  # the world group's
    # In the file about POLL_S (0.2 s) after the rank began waiting; the margin is for a loaded machine.
    assert seen_at0 - waiting0["ts"] < 3.0 and seen_at1 - waiting1["ts"] < 3.0
    # The stall's Flight Recorder dump, one file per rank, shows the op each waits in as still running.
    assert sorted(dumps) == [0, 1]
    for rank, waiting in ((0, waiting0), (1, waiting1)):
        dump = json.loads(dumps[rank].read_text())
        assert dump["rank"] == rank and dump["attempt"] == 0 and dump["reason"] == "stall in comm.all_reduce"
        group, seq = waiting["attrs"][S.ATTR_COMM_GROUP], waiting["attrs"][S.ATTR_COMM_SEQ]
        entry = next(e for e in dump["entries"] if e["process_group"][0] == group and e["collective_seq_id"] == seq)
        assert entry["profiling_name"] == "gloo:all_reduce" and not entry["retired"]


P2P_BEFORE_INIT = '''
import os, sys
import torch, torch.distributed as dist
import otel_train as ot
dist.init_process_group("gloo")
rank, peer = dist.get_rank(), 1 - dist.get_rank()
sent, got = torch.full((5,), float(rank)), torch.zeros(5)
ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, got, peer)]  # the originals: before init
ot.init(save_path=sys.argv[1], enabled=True)
with ot.training_step(0):
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert got.tolist() == [float(peer)] * 5
    if rank == 0:
        dist.send(torch.ones(2, dtype=torch.int64), 1)
    else:
        dist.recv(torch.zeros(2, dtype=torch.int64))  # from any source: the sender is the peer
ot.shutdown()
dist.destroy_process_group()
'''


def test_p2p_ops_made_before_init_are_recorded_and_matched(tmp_path: Path) -> None:
    script = tmp_path / "p2p.py"
    script.write_text(P2P_BEFORE_INIT)
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(save)]
    done = subprocess.run(cmd, cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=240,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = by_rank(save)
    check_comm(runs, 2)
    assert check_p2p(runs) == 3  # the batch: 0 -> 1 and 1 -> 0; then 0 -> 1 once more
    for rank, recs in runs.items():
        spans = [(s["name"], op_attrs(s, e)[S.ATTR_COMM_SEQ], op_attrs(s, e)[S.ATTR_COMM_PEER])
                 for s, e in comm_spans(recs)]
        peer = 1 - rank
        last = ("comm.send", 2, 1) if rank == 0 else ("comm.recv", 2, 0)
        assert sorted(spans) == sorted([("comm.send", 1, peer), ("comm.recv", 1, peer), last])
