"""The ``typical`` what-if against ground truth: 3-D jobs simulated event by event (tests/pipeline_sim.py)
with one injected cause each, the same job simulated without it (issue 17's targets: S within 3 %,
the top attribution right in every case, the shares)."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pipeline_sim import (
    CAUSES,
    EVERYONE,
    LAST_STAGE,
    SCHEDULES,
    Cause,
    Costs,
    Layout,
    Recording,
    Truth,
    make_groups,
    schedule_units,
    simulate,
    write_job,
)

from otel_train import schema
from otel_train.analysis.spans import load_run

S_TOLERANCE = 0.03
"""Issues 17 and 42: S within +-3 % of the truth, the published method's answer (OSDI '25: every op at
its typical time, launch gaps and waits zero) computed by the simulator itself (Truth.definition)."""
SHARE_TARGET = 0.9
"""Issue 17: shares.worker >= 0.9 for one slow worker, shares.last_stage >= 0.9 for stage imbalance."""
MAJORITY = 0.5
"""A share above this names a worker (or the last stage) as the cause; below, nobody alone."""
DP_OPS = ("comm.all_reduce", "comm.reduce_scatter", "comm.all_gather")
P2P_OPS = ("comm.send", "comm.recv")

# (dp, pp, tp, microbatches): 8, 12 and 16 ranks, rotated so each cause meets every size; one 64-rank case.
SIZES = ((2, 4, 1, 8), (2, 3, 2, 6), (2, 4, 2, 8))
CASES = [(schedule, cause, SIZES[(j + k) % len(SIZES)], 10 + 6 * k + j)
         for k, schedule in enumerate(SCHEDULES) for j, cause in enumerate((None, *CAUSES))]
BIG = ("1f1b", "worker", (4, 4, 4, 8), 99)
STEPS = 4

DEFINITION_TOLERANCE = 0.01
"""Our S against the published answer replayed exactly (Truth.definition), in every case: the
implementation's own error (a recv's bimodal transfer gave 1-1.6 % before the recv joined its send's end)."""
MEAN_HOLDS_THE_WORKER: dict[tuple[str, str | None, tuple[int, int, int, int]], str] = {
    ("gpipe", "worker", (2, 3, 2, 6)): "published S 1.252 vs the clean twin's 1.292 (-3.1 %)",
    ("interleaved", "worker", (2, 4, 1, 8)): "published S 1.162 vs the clean twin's 1.226 (-5.2 %)",
}
"""Cases whose published answer is more than 3 % below the job without its cause (the clean twin): the
typical duration of an op is the MEAN over all ranks (OSDI '25), the slow worker's included, so with N
ranks the ideal keeps (1.5 - 1)/N of its slowdown in every compute op (docs/analysis.md 'Simulator')."""


def attribution(out: dict[str, Any]) -> Any:
    """What a what-if answer names as the cause, in the truth's terms (pipeline_sim.Truth.top):
    a data-parallel collective's name when it is the costliest phase; the pair of the two costliest
    ranks when a p2p op is; else the costliest rank when ``shares.worker`` is a majority, the last
    stage when ``shares.last_stage`` is, and "everyone" when neither is."""
    phases = sorted(out["by_phase"], key=lambda r: -r["slowdown"])
    ranks = sorted(out["by_rank"], key=lambda r: -r["slowdown"])
    top_phase = phases[0]["phase"]
    if top_phase in DP_OPS:
        return top_phase
    if top_phase in P2P_OPS:
        return tuple(sorted(r["rank"] for r in ranks[:2]))
    shares = {k: v or 0.0 for k, v in out["shares"].items()}  # None: nothing to share
    if shares["worker"] >= MAJORITY:
        return ranks[0]["rank"]
    if shares["last_stage"] >= MAJORITY:
        return LAST_STAGE
    return EVERYONE


def typical(path: Path) -> dict[str, Any]:
    from otel_train.analysis.whatif import whatif

    return whatif(load_run(path, warn=pytest.fail), method="typical")


def check(out: dict[str, Any], truth: Truth) -> None:
    """The targets for one case, with every number in the message when one is missed: S within 3 %
    (and within 1 %: the implementation's own error) of the published answer the simulator computes,
    the replay of the run's own durations equal to its measured step, the cause named, the shares."""
    steps = [int(k) for k in out["per_step"]]
    got, twin, want = out["slowdown"], truth.over(steps), truth.definition(steps)
    actual = float(np.mean([truth.step_ms[k] for k in steps]))
    seen = attribution(out)
    detail = (f"S {got:.4f} vs truth {want:.4f} (the published answer computed by the simulator; the clean "
              f"twin's {twin:.4f}; actual {out['step_ms']['actual']:.2f} / ideal {out['step_ms']['ideal']:.2f} ms; "
              f"truth {actual:.2f} / {actual / want:.2f}, steps {steps}); "
              f"named {seen!r}, truth {truth.top!r}; shares {out['shares']}; "
              f"top ranks {sorted(out['by_rank'], key=lambda r: -r['slowdown'])[:3]}; "
              f"top phases {sorted(out['by_phase'], key=lambda r: -r['slowdown'])[:3]}")
    assert out["method"] == "typical", detail
    assert abs(got / want - 1.0) <= S_TOLERANCE, detail
    assert abs(got / want - 1.0) <= DEFINITION_TOLERANCE, detail  # the implementation's own error
    assert len(steps) >= STEPS - 1, detail
    assert out["step_ms"]["actual"] == pytest.approx(actual, rel=1e-3), detail  # its own durations: the run
    if truth.cause is None:
        return
    assert seen == truth.top, detail
    if truth.cause.kind == "worker":
        assert out["shares"]["worker"] >= SHARE_TARGET, detail
    if truth.cause.kind == "last_stage":
        assert out["shares"]["last_stage"] >= SHARE_TARGET, detail


Case = tuple[str, "str | None", tuple[int, int, int, int], int]


@pytest.fixture(scope="module")
def solve(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], tuple[dict[str, Any], Truth]]:
    """A case's what-if answer and truth, each job written and answered once per module."""
    done: dict[Case, tuple[dict[str, Any], Truth]] = {}

    def get(case: Case) -> tuple[dict[str, Any], Truth]:
        if case not in done:
            schedule, cause, (dp, pp, tp, m), seed = case
            path = tmp_path_factory.mktemp("run") / "run"
            truth = write_job(path, dp=dp, pp=pp, tp=tp, steps=STEPS, microbatches=m, schedule=schedule,
                              cause=cause, seed=seed)
            done[case] = (typical(path), truth)
        return done[case]

    return get


def _id(schedule: str, cause: str | None, size: tuple[int, int, int, int], seed: int) -> str:
    dp, pp, tp, _ = size
    return f"{schedule}-{cause or 'clean'}-dp{dp}pp{pp}tp{tp}"


@pytest.mark.parametrize("schedule,cause,size,seed", [pytest.param(*c, id=_id(*c)) for c in [*CASES, BIG]])
def test_typical_finds_the_injected_cause(solve: Callable[[Case], tuple[dict[str, Any], Truth]], schedule: str,
                                          cause: str | None, size: tuple[int, int, int, int], seed: int) -> None:
    """Every target, in every case (the two slow-worker cases of MEAN_HOLDS_THE_WORKER included)."""
    out, truth = solve((schedule, cause, size, seed))
    check(out, truth)


@pytest.mark.parametrize("schedule,cause,size,seed", [
    pytest.param(*c, id=_id(*c)) for c in [*CASES, BIG] if c[:3] in MEAN_HOLDS_THE_WORKER])
def test_the_published_answer_keeps_part_of_a_slow_worker_in_its_ideal(
        solve: Callable[[Case], tuple[dict[str, Any], Truth]], schedule: str, cause: str | None,
        size: tuple[int, int, int, int], seed: int) -> None:
    """The published answer (the truth above) against the job without its cause: more than 3 % below it
    where the mean holds the straggler (MEAN_HOLDS_THE_WORKER); a change of the definition shows up here."""
    out, truth = solve((schedule, cause, size, seed))
    steps = [int(k) for k in out["per_step"]]
    why = MEAN_HOLDS_THE_WORKER[(schedule, cause, size)]
    assert truth.definition(steps) < truth.over(steps) * (1.0 - S_TOLERANCE), why


def test_typical_survives_microsecond_p2p_ops(tmp_path: Path) -> None:
    """Back-to-back p2p ops of 1 us (eager sends of small tensors; before 0a58b7a their ties made the
    graph cyclic and whatif raised): the what-if answers, reproduces the run, stays within the target."""
    truth = write_job(tmp_path / "run", dp=2, pp=4, tp=2, steps=STEPS, microbatches=8, schedule="1f1b",
                      cause="link", seed=17, costs=Costs(link_ms=0.001, recv_ms=0.001))
    out = typical(tmp_path / "run")
    steps = [int(k) for k in out["per_step"]]
    assert out["step_ms"]["actual"] == pytest.approx(np.mean([truth.step_ms[k] for k in steps]), rel=1e-3)
    assert abs(out["slowdown"] / truth.over(steps) - 1.0) <= S_TOLERANCE


# ---------------------------------------------------------------------------------------------
# Issue 42: the patterns of production traces, each with the simulator's own published answer as truth

PATTERNS = [  # (id, schedule, cause, (dp, pp, tp, microbatches), seed, how the records are written)
    ("untraced-recv-worker", "1f1b", "worker", (2, 4, 1, 8), 3, Recording(untraced_recv=True)),
    ("untraced-recv-last_stage", "1f1b", "last_stage", (2, 4, 2, 8), 4, Recording(untraced_recv=True)),
    ("waits-outside-worker", "1f1b", "worker", (4, 4, 1, 8), 5, Recording(waits_outside=True)),
    ("waits-outside-worker-gpipe", "gpipe", "worker", (2, 3, 2, 6), 6, Recording(waits_outside=True)),
    ("overlap-worker", "1f1b", "worker", (2, 4, 2, 8), 7, Recording(overlap=0.4, seed=7)),
    ("overlap-last_stage", "interleaved", "last_stage", (2, 4, 1, 8), 8, Recording(overlap=0.4, seed=8)),
    ("device-clock-worker", "1f1b", "worker", (2, 4, 1, 8), 9, Recording(device_clock=True)),
    ("device-clock-seqlen", "1f1b", "seqlen", (2, 4, 1, 8), 10, Recording(device_clock=True)),
]


@pytest.mark.parametrize("schedule,cause,size,seed,recording", [pytest.param(*c[1:], id=c[0]) for c in PATTERNS])
def test_typical_holds_on_production_patterns(tmp_path: Path, schedule: str, cause: str,
                                              size: tuple[int, int, int, int], seed: int, recording: Recording) -> None:
    """Idle waits outside spans (an untraced recv; a data-parallel collective whose span begins at its last
    arrival, so a slow worker's stage peers wait for it untraced), device-stream overlaps (comm/compute
    3-15 us, comm/comm up to 0.14 ms) and device-clock comm ops: every target against the published
    answer the simulator computes; before issue 42 these gave S 0.98-1.05 against truths of 1.12-1.25."""
    dp, pp, tp, m = size
    truth = write_job(tmp_path / "run", dp=dp, pp=pp, tp=tp, steps=STEPS, microbatches=m, schedule=schedule,
                      cause=cause, seed=seed, recording=recording)
    out = typical(tmp_path / "run")
    check(out, truth)
    assert "left_out" not in out  # every op used, the device-clock ones included
    assert any(r["phase"].startswith(schema.COMM_PREFIX) for r in out["by_phase"])
    if recording.untraced_recv or recording.waits_outside:
        assert out["waits"] > 0
    assert out["snapped"] == truth.moved  # each op written with an overlap, snapped; none other
    assert (truth.moved > 0) == (recording.overlap > 0)
    if cause == "worker":  # the ranks that waited for it (in recvs, or outside spans) are not charged
        siblings = {r for r in range(truth.layout.world) if r // tp == truth.top // tp}
        assert max(r["slowdown"] for r in out["by_rank"] if r["rank"] not in siblings) <= 1.01, out["by_rank"]
        stage = truth.layout.coords(truth.top)[1]
        assert max(out["by_dim"]["pp"], key=lambda r: r["slowdown"])["index"] == stage, out["by_dim"]


# ---------------------------------------------------------------------------------------------
# The simulator itself: the ground truth has to be true


def test_the_definition_is_exact_where_the_mean_is_the_truth() -> None:
    """Replaying the contract's ideal inside the simulator (Truth.definition): without jitter it is the
    truth exactly for a clean job, a stage imbalance (the mean *is* the balanced stage) and sequence
    imbalance (lengths average to 1 each step); for one slow worker it is short by the share the
    worker adds to the mean."""
    quiet = Costs(jitter=0.0)
    for cause in (None, "last_stage", "seqlen"):
        truth = write_job_in_memory(cause, quiet)
        assert truth.definition() == pytest.approx(truth.slowdown, rel=1e-9), cause
    worker = write_job_in_memory("worker", quiet)
    assert worker.definition() < worker.slowdown * 0.97


def write_job_in_memory(cause: str | None, costs: Costs) -> Truth:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return write_job(Path(d), dp=2, pp=4, tp=1, steps=3, microbatches=8, schedule="1f1b", cause=cause,
                         seed=2, costs=costs)


def test_schedules_match_the_textbook_step_time() -> None:
    """Without comm costs and jitter, a step is (m + p - 1)(f + b) for GPipe and 1F1B and
    (m + (p - 1)/v)(f + b) for interleaved 1F1B with v chunks (Narayanan et al., SC '21)."""
    quiet = Costs(tp_ms=0.0, link_ms=0.0, recv_ms=0.0, dp_ms=0.0, optimizer_ms=0.0, jitter=0.0)
    for schedule, m, v in (("gpipe", 8, 1), ("1f1b", 8, 1), ("1f1b", 5, 1), ("interleaved", 8, 2),
                           ("interleaved", 12, 3)):
        layout = Layout(1, 4, 1, m, schedule, v)
        _, sim, _ = simulate(layout, 2, quiet, None, 0, clean=False)
        assert sim.step_times() == pytest.approx([(m + 3 / v) * 12.0] * 2), (schedule, m, v)


def test_one_f_one_b_keeps_at_most_p_minus_s_microbatches_in_flight() -> None:
    layout = Layout(1, 4, 1, 8, "1f1b")
    for stage in range(4):
        units, live, peak = schedule_units(layout, stage), 0, 0
        for kind, _, _ in units:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - stage and live == 0
        assert sorted(u for u in units if u[0] == "B") == [("B", i, 0) for i in range(8)]


def _spans(path: Path) -> dict[int, list[dict]]:
    """Every closed span of every rank, as {name, start, end, attrs}, from the files written."""
    out: dict[int, list[dict]] = {}
    for f in sorted((path / schema.STRUCTURED_LOGS_DIR).iterdir()):
        starts, spans = {}, []
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["kind"] == schema.SPAN_START:
                starts[rec["span_id"]] = rec
            elif rec["kind"] == schema.SPAN_END:
                s = starts.pop(rec["span_id"])
                spans.append({"name": rec["name"], "start": s["ts"], "end": rec["ts"], "attrs": s["attrs"],
                              "step": s.get("step"), "dur": rec["dur_ms"]})
        assert not starts
        out[rec["rank"]] = spans
    return out


def test_records_keep_the_dependencies(tmp_path: Path) -> None:
    """In the files: every recv ends after its send (matched by pair and seq), every collective
    ends at once for all members and after the last arrival, every group is declared."""
    truth = write_job(tmp_path / "run", dp=2, pp=3, tp=2, steps=2, microbatches=6, schedule="interleaved",
                      chunks=2, cause="link", seed=3)
    spans = _spans(tmp_path / "run")
    assert len(spans) == truth.layout.world == 12
    sends = {(r, s["attrs"]["comm.peer"], s["attrs"]["comm.seq"]): s for r, ss in spans.items() for s in ss
             if s["name"] == "comm.send"}
    recvs = [(r, s) for r, ss in spans.items() for s in ss if s["name"] == "comm.recv"]
    assert len(recvs) == len(sends) > 0
    for r, s in recvs:
        send = sends[(s["attrs"]["comm.peer"], r, s["attrs"]["comm.seq"])]
        assert s["end"] >= send["end"] - 1e-6
    colls: dict[tuple[str, int], list[dict]] = {}
    for ss in spans.values():
        for s in ss:
            if s["name"] in ("comm.all_reduce",):
                colls.setdefault((s["attrs"]["comm.group"], s["attrs"]["comm.seq"]), []).append(s)
    groups = make_groups(truth.layout).members
    for (gid, _), members in colls.items():
        assert len(members) == len(groups[gid][1])
        assert max(m["end"] for m in members) - min(m["end"] for m in members) < 2e-6
        assert min(m["end"] for m in members) >= max(m["start"] for m in members) - 1e-6
    # the tp all_reduces are children of forward/backward; the compute spans carry their microbatch
    fwd = [s for s in spans[0] if s["name"] == "forward"]
    assert sorted({(s["attrs"]["microbatch"], s["attrs"]["chunk"]) for s in fwd}) == \
        [(mb, c) for mb in range(6) for c in range(2)]
    run = load_run(tmp_path / "run", warn=pytest.fail)
    assert {d.rank for d in run.processes} == set(range(12))


def test_truth_is_the_job_without_its_cause(tmp_path: Path) -> None:
    """A clean job's truth is S = 1 exactly; a cause slows the job; the clean twin of a stage
    imbalance has the same total compute (the same work, spread evenly)."""
    clean = write_job(tmp_path / "a", dp=2, pp=4, tp=1, steps=3, microbatches=8, schedule="gpipe", seed=5)
    assert clean.slowdown == 1.0 and clean.top is None
    slow = write_job(tmp_path / "b", dp=2, pp=4, tp=1, steps=3, microbatches=8, schedule="gpipe",
                     cause=Cause("worker", factor=1.5, rank=3), seed=5)
    assert slow.top == 3 and slow.slowdown > 1.2
    assert slow.clean_step_ms == pytest.approx(clean.clean_step_ms)
    layout = Layout(2, 4, 1, 8, "1f1b")
    work = []
    for is_clean in (False, True):
        _, sim, _ = simulate(layout, 2, Costs(jitter=0.0), Cause("last_stage", factor=1.5), 0, clean=is_clean)
        work.append(sum(e2[1] - e1[1] for ev in sim.events for e1, e2 in zip(ev, ev[1:])
                        if e1[0] == "open" and e1[2] in ("forward", "backward") and e2[0] == "close"))
    assert work[0] == pytest.approx(work[1], rel=1e-9)


def test_sequence_lengths_keep_each_steps_tokens() -> None:
    _, _, plan = simulate(Layout(2, 3, 1, 6, "1f1b"), 3, Costs(), Cause("seqlen"), 7, clean=False)
    assert plan.lengths.mean(axis=(1, 2)) == pytest.approx(np.ones(3))
    assert plan.lengths.std() > 0.1


def test_bad_layouts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interleaved needs"):
        write_job(tmp_path, dp=1, pp=2, tp=1, schedule="interleaved")
    with pytest.raises(ValueError, match="dp >= 2"):
        write_job(tmp_path, dp=1, pp=2, tp=1, cause="collective")
    with pytest.raises(ValueError, match="cause must be"):
        write_job(tmp_path, cause="cosmic rays")


def test_summarize_names_the_slow_worker_not_the_ranks_its_pipeline_made_wait(tmp_path: Path) -> None:
    """A 1F1B job with one slow worker, over enough steps for the straggler rules (10 at least): the
    slow rank is named, and the other stages of its replica, late at their data-parallel all-reduce
    only because they waited in recvs for it, are not (the arrival rule named them before;
    findings.ARRIVAL_VICTIM_SHARE)."""
    from typer.testing import CliRunner

    from otel_train.cli import app

    truth = write_job(tmp_path / "run", dp=2, pp=4, tp=1, steps=20, microbatches=8, schedule="1f1b",
                      cause="worker", seed=3)
    done = CliRunner().invoke(app, ["summarize", str(tmp_path / "run"), "--json"])
    assert done.exit_code == 0, done.output
    found = [f for f in json.loads(done.output)["findings"] if f["kind"] == "straggler"]
    assert found and {f["rank"] for f in found} == {truth.top}, found


def test_a_split_simulation_gives_the_same_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """graph.simulate_split: half the scenarios simulated by a forked copy (a large run's what-if) give
    the answer of one process, to the last bit; the fork is counted, so the test fails without one."""
    import concurrent.futures

    from otel_train.analysis import graph_sim, pools

    write_job(tmp_path / "run", dp=2, pp=4, tp=1, steps=STEPS, microbatches=8, schedule="1f1b", cause="worker",
              seed=5)
    alone = typical(tmp_path / "run")
    monkeypatch.setattr(graph_sim, "SPLIT_MIN", 0)
    forks: list[int] = []

    class Counted(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            forks.append(1)
            super().__init__(*args, **kwargs)

    # pools imports the pool where it forks the copy (a small read never pays for the import): patched at its source.
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Counted)
    # Forked whatever threads an earlier test left behind (the library itself forks only with one thread).
    monkeypatch.setattr(pools, "pool_context", lambda: multiprocessing.get_context("fork"))
    split = typical(tmp_path / "run")
    assert json.dumps(split, sort_keys=True) == json.dumps(alone, sort_keys=True)
    assert len(forks) == 1  # the answer's scenarios; the worker-share pass is one scenario: never split
