"""whatif over the dependency graph (otel_train/analysis/graph.py): both methods on hand-built runs
with known answers, written as real JSONL records (tests/analysis_fixtures.py's encoder).

The runs come from a small event simulator (:func:`play`): each rank runs a program of compute ops,
eager sends, blocking recvs (they end ``latency`` ms after both the recv was posted and its send ended) and collectives
(everyone leaves ``tail`` ms after the last member arrived), and writes the spans it would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import comm_attrs
from sync_sim import base as sync_base
from sync_sim import simulate as sync_simulate
from typer.testing import CliRunner

from otel_train import schema
from otel_train.analysis import graph
from otel_train.analysis.spans import load_run
from otel_train.analysis.whatif import whatif
from otel_train.cli import app
from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER, STEP

CONTRACT = {"method", "step_ms", "slowdown", "by_rank", "by_phase", "by_dim", "shares", "per_step", "steps"}


@dataclass
class Op:
    kind: str  # compute | send | recv | coll
    name: str = ""
    dur: float = 0.0
    peer: int = -1
    group: str = ""
    seq: int = 0
    tail: float = 1.0
    latency: float = 0.5
    rendezvous: bool = False  # a send that blocks until its recv is posted (gloo's, NCCL's)


@dataclass
class Rank:
    proc: Proc
    program: list[tuple[int, Op]]  # (step, op)
    pc: int = 0
    step: int | None = None
    sent: dict = field(default_factory=dict)


def play(ranks: list[Rank]) -> None:
    """Run every rank's program to its end (see the module doc), writing its records."""
    sends: dict[tuple[str, int, int, int], float] = {}  # (group, src, dst, seq) -> the send's end
    posted: dict[tuple[str, int, int, int], float] = {}  # ... -> when the recv was posted
    arrived: dict[tuple[str, int], dict[int, float]] = {}
    members: dict[str, int] = {}
    for r in ranks:
        for _, op in r.program:
            if op.kind == "coll":
                members[op.group] = members.get(op.group, 0)
    for g in members:
        members[g] = len({r.proc.rank for r in ranks for _, op in r.program if op.kind == "coll" and op.group == g})
    while any(r.pc < len(r.program) for r in ranks):
        moved = False
        for r in ranks:
            while r.pc < len(r.program) and _advance(r, sends, arrived, members, posted):
                moved = True
        assert moved, "the programs deadlock"
    for r in ranks:
        r.proc.end()  # the last step
        r.proc.shutdown()


def _advance(r: Rank, sends: dict, arrived: dict, members: dict, posted: dict) -> bool:
    step, op = r.program[r.pc]
    p = r.proc
    if step != r.step:
        if r.step is not None:
            p.end()
        p.set_step(step)
        p.start(STEP)
        r.step = step
    me = p.rank
    if op.kind == "recv":
        key = (op.group, op.peer, me, op.seq)
        if key not in posted:
            posted[key] = p.now_ms
            p.start(schema.comm_span_name("recv"), **comm_attrs(op.group, op.seq, peer=op.peer))
        if key not in sends:
            return False
        p.now_ms = max(p.now_ms, sends[key]) + op.latency  # the data moves once both are there
        p.end()
    elif op.kind == "coll":
        seen = arrived.setdefault((op.group, op.seq), {})
        if me not in seen:
            seen[me] = p.now_ms
            p.start(schema.comm_span_name(op.name or "all_reduce"), **comm_attrs(op.group, op.seq))
        if len(seen) < members[op.group]:
            return False
        p.now_ms = max(seen.values()) + op.tail
        p.end()
    elif op.kind == "send":
        key = (op.group, me, op.peer, op.seq)
        if key not in r.sent:
            r.sent[key] = p.now_ms
            p.start(schema.comm_span_name("send"), **comm_attrs(op.group, op.seq, peer=op.peer))
        if op.rendezvous:
            if key not in posted:
                return False
            p.now_ms = max(p.now_ms, posted[key])
        p.advance(0.05)
        p.end()
        sends[(op.group, me, op.peer, op.seq)] = p.now_ms  # the data is there once the send is done
    else:
        p.start(op.name)
        p.advance(op.dur)
        p.end()
    r.pc += 1
    return True


Dur = Callable[[int, int, str, int, int], float]  # (rank, stage, phase, step, microbatch) -> ms


def base_dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
    return {DATA_FETCH: 2.0, FORWARD: 10.0, BACKWARD: 20.0, OPTIMIZER: 3.0}[phase]


def pipeline(path: Path, dp: int, pp: int, steps: int, micro: int = 4, dur: Dur = base_dur,
             latency: Callable[[int, int], float] = lambda src, dst: 0.5, mesh: bool = True,
             rendezvous: bool = False) -> Path:
    """A GPipe run, ``dp`` x ``pp`` ranks (rank = d * pp + stage): every stage receives each
    microbatch's activations, runs forward, sends them on; then backward in reverse with the
    gradients; then the gradient all-reduce among each stage's data-parallel ranks, and optimizer."""
    world = dp * pp
    procs = [Proc(rank=r, world_size=world) for r in range(world)]
    programs: list[list[tuple[int, Op]]] = [[] for _ in procs]
    for p in procs:
        d, k = divmod(p.rank, pp)
        for g, desc, ranks in ((f"pp{d}", "pp", [d * pp + s for s in range(pp)]),
                               (f"dp{k}", "dp", [e * pp + k for e in range(dp)])):
            p.instant(schema.INSTANT_COMM_GROUP, group=g, desc=desc, ranks=ranks)
        if mesh:
            p.instant(schema.INSTANT_MESH, dims={"dp": dp, "pp": pp}, coords={"dp": d, "pp": k})
    for s in range(steps):
        for p in procs:
            d, k = divmod(p.rank, pp)
            prog, r = programs[p.rank], p.rank
            prog.append((s, Op("compute", DATA_FETCH, dur(r, k, DATA_FETCH, s, 0))))
            for m in range(micro):
                if k > 0:
                    prog.append((s, Op("recv", peer=r - 1, group=f"pp{d}", latency=latency(r - 1, r))))
                prog.append((s, Op("compute", FORWARD, dur(r, k, FORWARD, s, m))))
                if k < pp - 1:
                    prog.append((s, Op("send", peer=r + 1, group=f"pp{d}", rendezvous=rendezvous)))
            for m in reversed(range(micro)):
                if k < pp - 1:
                    prog.append((s, Op("recv", peer=r + 1, group=f"pp{d}", latency=latency(r + 1, r))))
                prog.append((s, Op("compute", BACKWARD, dur(r, k, BACKWARD, s, m))))
                if k > 0:
                    prog.append((s, Op("send", peer=r - 1, group=f"pp{d}", rendezvous=rendezvous)))
            if dp > 1:
                prog.append((s, Op("coll", "all_reduce", group=f"dp{k}", seq=s, tail=1.0)))
            prog.append((s, Op("compute", OPTIMIZER, dur(r, k, OPTIMIZER, s, 0))))
    _renumber(programs)
    play([Rank(p, prog) for p, prog in zip(procs, programs)])
    write_run(path, procs)
    return path


def _renumber(programs: list[list[tuple[int, Op]]]) -> None:
    """The k-th send from A to B and the k-th recv on B from A carry seq k."""
    sends: dict[tuple[int, int], int] = {}
    recvs: dict[tuple[int, int], int] = {}
    for rank, prog in enumerate(programs):
        for _, op in prog:
            if op.kind == "send":
                op.seq = sends[(rank, op.peer)] = sends.get((rank, op.peer), -1) + 1
            elif op.kind == "recv":
                op.seq = recvs[(op.peer, rank)] = recvs.get((op.peer, rank), -1) + 1


def by(rows: list[dict], key: str) -> dict:
    return {r[key]: r["slowdown"] for r in rows}


# ---------------------------------------------------------------------------------------------


def test_a_slow_last_stage_is_the_last_stages_share(tmp_path: Path) -> None:
    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return t * 1.6 if stage == 1 and phase in (FORWARD, BACKWARD) else t

    out = whatif(load_run(pipeline(tmp_path / "run", dp=2, pp=2, steps=12, dur=dur), warn=pytest.fail))
    assert out["method"] == "typical" and out["steps"] == 11
    ms = out["step_ms"]
    assert ms["actual"] == pytest.approx(ms["measured"], rel=1e-6)
    assert out["slowdown"] > 1.1
    assert out["shares"]["last_stage"] >= 0.9
    pp = {r["index"]: r["slowdown"] for r in out["by_dim"]["pp"]}
    assert pp[1] > 1.1 and pp[0] < 1.0  # stage 0 alone as measured: faster than the mean of both
    dp = {r["index"]: r["slowdown"] for r in out["by_dim"]["dp"]}
    assert dp[0] == pytest.approx(dp[1], rel=1e-6)  # both data-parallel replicas are alike


def test_a_slow_stage_behind_rendezvous_sends_is_the_slow_stage(tmp_path: Path) -> None:
    """gloo's and NCCL's sends block until their recv is posted: a slow stage 1 shows up as stage 0's
    long sends. A send that waited for its recv ends its own transfer after the later of the two
    arrivals, so that waiting is charged to the stage that posted the recv late, not to the sender."""
    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return t * 1.6 if stage == 1 and phase in (FORWARD, BACKWARD) else t

    path = pipeline(tmp_path / "run", dp=2, pp=2, steps=12, dur=dur, rendezvous=True)
    records = [json.loads(line) for f in path.rglob("*.jsonl") for line in f.read_text().splitlines()]
    waited = [r["dur_ms"] for r in records if r.get("kind") == "span_end" and r.get("name") == "comm.send"
              and r.get("rank") in (0, 1)]
    assert max(waited) > 5.0  # stage 0's sends did wait for stage 1's recvs
    run = load_run(path)
    g = graph.build(run.groups()[0])
    masks = np.ones((1, g.fixed + 1), bool)
    np.testing.assert_allclose(graph.step_times(graph.simulate(g, masks))[0], np.diff(g.measured), atol=1e-6)
    out = whatif(run)
    pp = by(out["by_dim"]["pp"], "index")
    assert pp[1] > 1.1 and pp[0] < 1.0, out["by_dim"]
    assert out["shares"]["last_stage"] >= 0.9 and by(out["by_phase"], "phase")["comm.send"] < 1.01


def test_the_ideal_of_a_balanced_pipeline_is_its_step(tmp_path: Path) -> None:
    out = whatif(load_run(pipeline(tmp_path / "run", dp=2, pp=2, steps=8)))
    # Records keep µs (timestamps) and 1/1000 ms (durations): the ideal is the measured step to about 1e-5.
    assert out["slowdown"] == pytest.approx(1.0, abs=1e-4)
    assert out["step_ms"]["ideal"] == pytest.approx(out["step_ms"]["measured"], rel=1e-4)
    assert set(out["by_dim"]) == {"dp", "pp"}
    assert {r["index"] for r in out["by_dim"]["dp"]} == {0, 1} and {r["index"] for r in out["by_dim"]["pp"]} == {0, 1}
    assert all(r["slowdown"] == pytest.approx(1.0, abs=1e-4) for r in out["by_rank"])


def test_one_slow_worker_is_the_worker_share(tmp_path: Path) -> None:
    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return t + 6.0 if rank == 5 and phase == FORWARD else t

    out = whatif(load_run(pipeline(tmp_path / "run", dp=4, pp=2, steps=10, dur=dur)))
    assert out["by_rank"][0]["rank"] == 5 and out["by_rank"][0]["slowdown"] > 1.1
    assert all(r["slowdown"] == pytest.approx(1.0, abs=0.02) for r in out["by_rank"][1:])
    assert out["workers"] == [5] and out["shares"]["worker"] >= 0.9
    assert max(out["by_dim"]["dp"], key=lambda r: r["slowdown"])["index"] == 2  # rank 5 = dp 2, pp 1
    assert by(out["by_phase"], "phase")[FORWARD] > 1.1


def test_a_slow_rank_in_data_parallel(tmp_path: Path) -> None:
    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return 20.0 if rank == 2 and phase == FORWARD else t

    out = whatif(load_run(pipeline(tmp_path / "run", dp=4, pp=1, steps=10, micro=1, dur=dur)), method="typical")
    # a step: data_fetch 2, forward (10, or 20 on rank 2), backward 20, all-reduce tail 1, optimizer 3
    assert out["step_ms"]["actual"] == pytest.approx(46.0, abs=1e-3)
    assert out["step_ms"]["ideal"] == pytest.approx(38.5, abs=1e-3)  # forward's mean: 12.5 ms
    ranks = by(out["by_rank"], "rank")
    assert ranks[2] == pytest.approx(46.0 / 38.5, rel=1e-4)
    assert all(ranks[r] == pytest.approx(1.0, abs=1e-4) for r in (0, 1, 3))
    assert by(out["by_phase"], "phase")[FORWARD] == pytest.approx(46.0 / 38.5, rel=1e-4)
    assert by(out["by_phase"], "phase")["comm.all_reduce"] == pytest.approx(1.0, abs=1e-4)
    assert out["per_step"] and all(v == pytest.approx(46.0 / 38.5, rel=1e-4) for v in out["per_step"].values())


def test_a_slow_p2p_link(tmp_path: Path) -> None:
    # Pipeline replica 1 (ranks 2 -> 3) has a 6 ms link; every other link 0.5 ms.
    out = whatif(load_run(pipeline(tmp_path / "run", dp=2, pp=2, steps=10,
                                   latency=lambda src, dst: 6.0 if (src, dst) == (2, 3) else 0.5)))
    assert out["slowdown"] > 1.05
    assert out["by_phase"][0]["phase"] == "comm.recv" and out["by_phase"][0]["collective"] is True
    assert out["by_rank"][0]["rank"] == 3  # the link's receiver
    assert {r["rank"] for r in out["by_rank"] if r["slowdown"] > 1.01} == {3}


def test_simulated_with_its_own_durations_a_run_reproduces_its_steps(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    noise = rng.uniform(0.5, 1.5, size=(8, 12, 4, 8))
    phases = {DATA_FETCH: 0, FORWARD: 1, BACKWARD: 2, OPTIMIZER: 3}

    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        return base_dur(rank, stage, phase, step, mb) * noise[rank, step, phases[phase], mb]

    run = load_run(pipeline(tmp_path / "run", dp=2, pp=4, steps=12, dur=dur))
    g = graph.build(run.groups()[0])
    assert g is not None and g.steps.size == 12
    masks = np.ones((1, g.fixed + 1), bool)
    simulated = graph.step_times(graph.simulate(g, masks))[0]
    np.testing.assert_allclose(simulated, np.diff(g.measured), atol=1e-6)
    out = whatif(run)
    assert out["step_ms"]["actual"] == pytest.approx(out["step_ms"]["measured"], rel=1e-9)
    assert out["slowdown"] > 1.0  # the random durations made typical: some waiting goes


def test_peers_keeps_its_answers_and_is_the_graphs_data_parallel_case(tmp_path: Path) -> None:
    def times(rank: int, step: int) -> dict[str, float]:
        t = sync_base(rank, step)
        if rank == 3:
            t[DATA_FETCH] = 15.0
        return t

    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    sync_simulate(procs, 21, times)
    write_run(tmp_path, procs)
    run = load_run(tmp_path)
    old = whatif(run)  # no mesh: peers, the answers tests/test_whatif.py pins
    assert old["method"] == "peers" and old["step_ms"]["actual"] == pytest.approx(70.0, abs=1e-3)
    assert old["step_ms"]["ideal"] == pytest.approx(60.0, abs=1e-3) and old["by_rank"][0]["rank"] == 3
    assert set(old) >= CONTRACT and old["by_dim"] == {}
    new = whatif(run, method="typical")
    # The same steps through the graph (backward's end as the collective, as peers reads it) ...
    assert new["steps"] == old["steps"] == 20
    assert new["step_ms"]["actual"] == pytest.approx(old["step_ms"]["actual"], abs=1e-3)
    assert new["step_ms"]["measured"] == pytest.approx(70.0, abs=1e-3)
    # ... with typical = the mean over ranks (7.5 ms of data_fetch), not the peers' median (5 ms)
    assert new["step_ms"]["ideal"] == pytest.approx(62.5, abs=1e-3)
    assert new["by_rank"][0]["rank"] == 3 and new["by_dim"] == {}
    assert new["shares"]["last_stage"] is None and new["shares"]["worker"] == pytest.approx(1.0, abs=1e-4)


def test_unknown_method_is_refused(tmp_path: Path) -> None:
    run = load_run(pipeline(tmp_path / "run", dp=2, pp=1, steps=3, micro=1))
    with pytest.raises(ValueError, match="peers, typical"):
        whatif(run, method="median")


def test_cli_json_text_method_and_window(tmp_path: Path) -> None:
    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return t * 1.6 if stage == 1 and phase in (FORWARD, BACKWARD) else t

    run = pipeline(tmp_path / "run", dp=2, pp=2, steps=12, dur=dur)
    result = CliRunner().invoke(app, ["whatif", str(run), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= CONTRACT and out["method"] == "typical"
    assert set(out["step_ms"]) >= {"actual", "ideal", "measured"} and set(out["shares"]) == {"worker", "last_stage"}
    assert all(set(r) >= {"index", "slowdown"} for rows in out["by_dim"].values() for r in rows)
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in out["per_step"].items())
    peers = json.loads(CliRunner().invoke(app, ["whatif", str(run), "--json", "--method", "peers"]).stdout)
    assert peers["method"] == "peers"
    text = CliRunner().invoke(app, ["whatif", str(run)])
    assert text.exit_code == 0, text.output
    assert "typical" in text.stdout and "last stage" in text.stdout and "pp" in text.stdout
    lines = [line.strip("│ ") for line in text.stdout.splitlines()]
    # A table's title is a line of its own, never folded to a narrow table's width.
    assert {"By mesh index: only its ranks as measured, all else typical",
            "Top phases: only that phase as measured, all else typical"} <= set(lines), text.stdout
    # A p2p op is a comm op, not a collective; the data-parallel all-reduce is one.
    rows = {line.split(" ")[0]: line for line in lines if line.startswith("comm.")}
    assert {"comm.send", "comm.recv", "comm.all_reduce"} <= set(rows), text.stdout
    assert "(collective)" in rows["comm.all_reduce"] and not any("(collective)" in rows[p] for p in ("comm.send", "comm.recv"))
    bad = CliRunner().invoke(app, ["whatif", str(run), "--method", "median"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1 and "peers" in bad.stderr
    window = whatif(load_run(run), window=(3, 8))
    assert window["steps"] == 5 and window["shares"]["last_stage"] >= 0.9


def test_typical_without_a_mesh(tmp_path: Path) -> None:
    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return t + 5.0 if rank == 1 and phase == BACKWARD else t

    run = pipeline(tmp_path / "run", dp=3, pp=1, steps=8, micro=1, dur=dur, mesh=False)
    assert whatif(load_run(run))["method"] == "peers"
    result = CliRunner().invoke(app, ["whatif", str(run), "--json", "--method", "typical"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["method"] == "typical" and out["by_dim"] == {} and out["shares"]["last_stage"] is None
    assert out["by_rank"][0]["rank"] == 1
    top = out["by_rank_phase"][0]
    assert (top["rank"], top["phase"]) == (1, BACKWARD)


@pytest.mark.parametrize("name, magic", [("heat.png", b"\x89PNG\r\n\x1a\n"), ("heat.svg", b"<?xml")])
def test_plot_with_a_mesh_is_dp_rank_by_stage(tmp_path: Path, name: str, magic: bytes) -> None:
    pytest.importorskip("matplotlib")
    from otel_train.analysis.plot import mesh_grid

    def dur(rank: int, stage: int, phase: str, step: int, mb: int) -> float:
        t = base_dur(rank, stage, phase, step, mb)
        return t + 6.0 if rank == 5 and phase == FORWARD else t

    run = pipeline(tmp_path / "run", dp=4, pp=2, steps=8, dur=dur)
    dps, pps, grid = mesh_grid(whatif(load_run(run)))
    assert (dps, pps) == ([0, 1, 2, 3], [0, 1])
    worst = max((v, d, p) for d, row in zip(dps, grid) for p, v in zip(pps, row))
    assert worst[1:] == (2, 1) and worst[0] > 1.1  # rank 5 = dp 2, stage 1
    out = tmp_path / "plots" / name
    result = CliRunner().invoke(app, ["whatif", str(run), "--json", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(magic) and out.stat().st_size > 5_000
    if name.endswith(".svg"):
        text = out.read_text()
        assert "dp 2" in text and "stage 1" in text and "pipeline stage" in text


def test_a_comm_op_tagged_with_a_later_step_stays_where_it_ran(tmp_path: Path) -> None:
    # Flight Recorder's buffer can give an op the step current when the recorder looked: rank 0's
    # setup broadcast, issued before step 0, carries step 3. It belongs with the spans around it.
    from comm_sim import declare, dp_steps
    from comm_sim import base as comm_base

    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    declare(procs)
    for p in procs:
        p.set_step(3)
        p.start(schema.comm_span_name("broadcast"), **comm_attrs("0", 0))
        p.advance(2.0)
        p.end()
    dp_steps(procs, range(8), comm_base, seq0=1)
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    out = whatif(load_run(tmp_path), method="typical")
    assert out["steps"] == 7 and all(v > 0 for v in out["per_step"].values())
    assert out["step_ms"]["actual"] == pytest.approx(out["step_ms"]["measured"], rel=1e-9)
    assert out["step_ms"]["measured"] == pytest.approx(62.0, abs=0.01)  # 5 + 20 + 30 + 2 + 5, every step


def _random_blocks(rng: np.random.Generator, blocks: int, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nodes offsets, src, dst) of random DAG blocks as graph.Graph keeps them: edges inside their
    block, from an earlier node of it or from a rank's boundary (src = -1 - rank)."""
    offsets, src, dst = [0], [], []
    for _ in range(blocks):
        n0, n = offsets[-1], int(rng.integers(5, 40))
        for v in range(n):
            for _ in range(int(rng.integers(1, 4))):
                u = int(rng.integers(-1, v)) if v else -1
                src.append(n0 + u if u >= 0 else -1 - int(rng.integers(ranks)))
                dst.append(n0 + v)
        offsets.append(n0 + n)
    return np.array(offsets), np.array(src, np.int64), np.array(dst, np.int64)


def _block_levels(nodes: np.ndarray, src: np.ndarray, dst: np.ndarray, b: int, ranks: int) -> np.ndarray:
    n0, n1 = nodes[b], nodes[b + 1]
    mine = (dst >= n0) & (dst < n1)
    s, d = src[mine], dst[mine]
    local = np.where(s < 0, -1 - s, ranks + s - n0)
    n = ranks + int(n1 - n0)
    level, _ = graph._levels(local, ranks + d - n0, n, np.ones(n, bool))
    return level[ranks:]


def test_all_blocks_levelled_at_once_equal_each_block_levelled_alone() -> None:
    """The plan's levels come from one Kahn pass over every block (1,000 blocks of the 64-rank
    benchmark: 1.15 s -> 0.3 s); a block with a cycle is marked (-1) and levelled alone, and its
    neighbours keep their levels."""
    from types import SimpleNamespace

    rng = np.random.default_rng(7)
    nodes, src, dst = _random_blocks(rng, 60, 4)
    at_once = graph._all_levels(SimpleNamespace(nodes=nodes, src=src, dst=dst))  # type: ignore[arg-type]
    for b in range(60):
        assert np.array_equal(at_once[nodes[b]:nodes[b + 1]], _block_levels(nodes, src, dst, b, 4)), b
    b = 30  # a cycle: the block's last node feeds its first
    cyc_src, cyc_dst = np.append(src, nodes[b + 1] - 1), np.append(dst, nodes[b])
    marked = graph._all_levels(SimpleNamespace(nodes=nodes, src=cyc_src, dst=cyc_dst))  # type: ignore[arg-type]
    assert (marked[nodes[b]:nodes[b + 1]] < 0).any()
    others = np.ones(marked.size, bool)
    others[nodes[b]:nodes[b + 1]] = False
    assert np.array_equal(marked[others], at_once[others])
