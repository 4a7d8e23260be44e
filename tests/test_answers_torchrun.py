"""whatif, diff, goodput and straggler findings on real multi-rank runs (torchrun, gloo on CPU).

One run of each kind per module, reused across the assertions (they are slow on two cores):
two clean runs and one with rank 1 slowed by 30 ms in data_fetch on every step; two small clean
runs started together beside a busy-loop process (CPU contention); and a run that fails once and
is restarted by ``torchrun --max-restarts=1``, resuming from its last checkpoint.

The clean and straggler runs compare step times measured on a shared two-core machine whose load
comes and goes, so they run side by side and most of their step waits without using the CPU
(``--gpu-wait-ms 50``, as a step waits on a GPU): what the CPU load does to the few ms of CPU work
stays small. No assertion needs two runs' step times to agree: what-if answers are judged within the
straggler run, against what its records say the injected sleep added; diff's are judged with a stated
tolerance (a third of the straggler's 30 ms). A straggler named where none was injected is admitted only
with the kernel's word that the machine kept that rank waiting for a CPU (tests/contention.py), however
loaded the machine was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ReadRecords
from contention import cpu_waits, excess_over_peers, starved, starved_by

from otel_train.analysis.diff import diff_runs
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize
from otel_train.analysis.whatif import whatif
from otel_train.phases import BACKWARD, DATA_FETCH, STEP

pytest.importorskip("torch.distributed")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
SLOW_RANK, SLOW_MS = 1, 30.0
STEADY = ("--hidden", "128", "--batch-size", "32", "--steps", "40", "--eval-every", "0", "--checkpoint-every", "0",
          "--gpu-wait-ms", "50", "--cpu-wait")
SMALL = ("--hidden", "128", "--batch-size", "32", "--steps", "60", "--eval-every", "0", "--checkpoint-every", "0",
         "--cpu-wait")


def torchrun(save_path: Path, *args: str, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra,
           str(EXAMPLE), "--save-path", str(save_path), *args]
    return subprocess.Popen(cmd, cwd=save_path.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finished(proc: subprocess.Popen[str], ok: bool = True) -> None:
    out, _ = proc.communicate(timeout=240)
    assert (proc.returncode == 0) is ok, out[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("answers")
    paths = {name: root / name for name in ("clean", "clean_2", "straggler", "busy_a", "busy_b")}
    # Side by side, so that whatever else loads the machine loads alike the runs that are compared.
    side_by_side = [torchrun(paths["clean"], *STEADY), torchrun(paths["clean_2"], *STEADY),
                    torchrun(paths["straggler"], *STEADY, "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS))]
    for proc in side_by_side:
        finished(proc)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        pair = [torchrun(paths["busy_a"], *SMALL), torchrun(paths["busy_b"], *SMALL)]
        for proc in pair:
            finished(proc)
    finally:
        busy.kill()
        busy.wait()
    return paths


def test_whatif_names_the_straggler_and_its_cost(runs: dict[str, Path]) -> None:
    slow = whatif(load_run(runs["straggler"]))
    assert slow["by_rank"][0]["rank"] == SLOW_RANK and slow["by_phase"][0]["phase"] == DATA_FETCH
    pair = slow["by_rank_phase"][0]
    assert (pair["rank"], pair["phase"]) == (SLOW_RANK, DATA_FETCH) and slow["steps"] == 39
    # Within the run: its ideal (every rank and phase made typical) takes out most of the straggler's
    # 30 ms (how closely: the next test).
    assert slow["step_ms"]["ideal"] < slow["step_ms"]["measured"] - 0.6 * SLOW_MS, slow["step_ms"]


def phase_excess_ms(records: list[dict[str, Any]], rank: int, phase: str) -> float:
    """How much longer ``rank``'s ``phase`` took than its peers' median, at the median step: read from the
    records themselves (span ends), not through any analysis."""
    durs: dict[int, dict[int, float]] = {}
    for r in records:
        if r.get("kind") == "span_end" and r.get("name") == phase and r.get("step") is not None:
            durs.setdefault(r["rank"], {})[r["step"]] = r["dur_ms"]
    return excess_over_peers(durs, rank)


def rank_jitter_ms(records: list[dict[str, Any]], skip: tuple[str, ...]) -> float:
    """How far apart two ranks' phases were, per step: |rank 0's ms - rank 1's ms| added up over every
    phase of every step both ranks ran but ``skip`` (and ``comm.*``), divided by those steps (a phase
    of one step, such as an eval, counts once, not as every step's). What a busy machine adds to one
    rank and not the other; what the two-rank ideal (each phase at the faster rank's values) takes
    out besides a straggler's excess. A quiet run here: 2.8 ms of a 90 ms step."""
    durs: dict[tuple[str, int], dict[int, float]] = {}
    for r in records:
        name = r.get("name", "")
        if r.get("kind") == "span_end" and r.get("step") is not None and not name.startswith("comm."):
            per = durs.setdefault((name, r["rank"]), {})
            per[r["step"]] = per.get(r["step"], 0.0) + r["dur_ms"]
    steps = set(durs.get((STEP, 0), {})) & set(durs.get((STEP, 1), {}))
    apart = sum(abs(durs[(name, 0)][s] - durs[(name, 1)][s])
                for name in {n for n, _ in durs} - {STEP, *skip} if (name, 0) in durs and (name, 1) in durs
                for s in steps if s in durs[(name, 0)] and s in durs[(name, 1)])
    return apart / len(steps) if steps else 0.0


def test_whatif_ideal_and_top_rank_take_out_what_the_straggler_added(runs: dict[str, Path],
                                                                     read_records: ReadRecords) -> None:
    # Judged within the straggler run alone (issue 19: no test may depend on two real runs' timings
    # agreeing; a fresh-clone run beside a busy loop once measured the clean run 11.9 % slower than the
    # straggler run's ideal). What the injected sleep added to the straggler's phase is read from the
    # records; the what-if must take out that much, and no more than the run's own jitter besides:
    # beside a busy loop (run 50) the ideal took out 8.4 ms more than the straggler's 30.9 ms, the
    # two ranks' other phases that far apart step by step (the ideal keeps the faster rank's values).
    slow = whatif(load_run(runs["straggler"]))
    measured, ideal = slow["step_ms"]["measured"], slow["step_ms"]["ideal"]
    records = read_records(runs["straggler"])
    added = phase_excess_ms(records, SLOW_RANK, DATA_FETCH)
    assert added == pytest.approx(SLOW_MS, rel=0.3), added
    jitter = rank_jitter_ms(records, skip=(DATA_FETCH, BACKWARD))  # backward holds the waiting for the straggler
    assert (measured - added - jitter) * 0.9 <= ideal <= (measured - added) * 1.1, (slow["step_ms"], added, jitter)
    top = slow["by_rank"][0]
    assert top["rank"] == SLOW_RANK, top
    # Taking out the straggler's excess alone leaves the other rank's as it ran: where the busy machine
    # slowed rank 0 in a step, rank 0 is then that step's critical path, up to the jitter (fresh-clone
    # run 81, beside a busy loop: rank 1 alone took out 22.8 of its 30.1 ms, the ideal 29.6, jitter 5.4).
    low, high = measured / (measured - added + jitter) * 0.9, measured / (measured - added - jitter) * 1.1
    assert low <= top["slowdown"] <= high, (top, slow["step_ms"], added, jitter)


def test_summarize_names_the_straggler_with_its_cost(runs: dict[str, Path], read_records: ReadRecords) -> None:
    findings = summarize(runs["straggler"], warn=pytest.fail)["findings"]
    mine = [f for f in findings if (f["kind"], f["rank"]) == ("straggler", SLOW_RANK)]
    assert len(mine) == 1, findings
    (f,) = mine
    assert f["phase"] == DATA_FETCH and f["p_value"] < 1e-6 and f["excess_ms"] == pytest.approx(SLOW_MS, rel=0.3), f
    assert f["cost_ms"] == pytest.approx(SLOW_MS, rel=0.3) and 0 < f["cost_pct"] < 100
    # Anything else named, whatever the machine's load, is a straggler the machine made, with the kernel's
    # word that it waited for a CPU (tests/contention.py): never rank 0 for waiting on rank 1, nothing else.
    waits = cpu_waits(read_records(runs["straggler"]))
    assert [g["message"] for g in findings if g is not f and not starved(g, waits)] == []


def test_diff_finds_the_slowed_rank_and_phase(runs: dict[str, Path]) -> None:
    """A regression, or (when the straggler's time against its peer drifted so much over the run that
    fewer than 5 independent blocks remain: seen once at 40 steps, tau 6.4 from a slower second
    third) the same change listed as undecided. Never "no change"."""
    out = diff_runs(load_run(runs["clean"]), load_run(runs["straggler"]))
    # Judged and undecided rows together: a fresh-clone run had the straggler's data_fetch undecided
    # (too few blocks) beside a finding on rank 0's optimizer (0.34 -> 0.88 ms at the median: two real
    # runs side by side differ for real); another had rank 0's once-per-process build.data (one block a
    # side: never judged) +39.7 ms first among the undecided rows.
    named = out["findings"] + [{"kind": "undecided", **u} for u in out["undecided"]]
    mine = [f for f in named if (f["rank"], f["phase"]) == (SLOW_RANK, DATA_FETCH)]
    assert mine and mine[0]["kind"] in ("regression", "undecided"), (out["findings"], out["undecided"])
    assert mine[0]["delta_ms"] == pytest.approx(SLOW_MS, rel=0.3)
    if mine[0]["kind"] == "regression":  # judged: the largest change, so the first finding
        assert out["findings"][0] is mine[0], out["findings"]
    # Anything else judged is what two real runs differ by: under the stated tolerance (see below).
    assert all(abs(f["delta_ms"]) < CLEAN_TOLERANCE_MS for f in out["findings"] if f is not mine[0]), out["findings"]
    # Rank 0 now waits ~30 ms longer in backward's all-reduce: shown, but that waiting is no finding.
    waited = next(r for r in out["ranks"] if (r["rank"], r["phase"]) == (0, BACKWARD))
    assert waited["b_p50_ms"] - waited["a_p50_ms"] > 0.6 * SLOW_MS
    assert not any(f["phase"] == BACKWARD and f["rank"] == 0 for f in out["findings"])


CLEAN_TOLERANCE_MS = SLOW_MS / 3
"""Two real clean runs differ for real (the machine's load is not the same for both), by a few ms of
CPU work at most here; the statistics themselves are tested on synthetic runs with known
autocorrelation (tests/test_diff.py). What must hold whatever the load: diff never reports a change
between two clean runs as large as a third of the straggler's."""


def test_clean_against_clean_raises_nothing_large(runs: dict[str, Path]) -> None:
    out = diff_runs(load_run(runs["clean"]), load_run(runs["clean_2"]))
    assert all(abs(f["delta_ms"]) < CLEAN_TOLERANCE_MS for f in out["findings"]), out["findings"]


def test_no_straggler_in_clean_runs_under_cpu_contention(runs: dict[str, Path], read_records: ReadRecords) -> None:
    # Two jobs and a busy loop on two cores: every rank is descheduled now and then. When the scheduler
    # keeps one rank beside the busy loop for the whole run, that rank is a real straggler, as a rank on a
    # host with a noisy neighbour is: it is named only with the kernel's word (its schedstat run delay)
    # that it waited for a CPU, step after step, beyond its peers, about as long as it was late
    # (tests/contention.py). The clean runs too, however loaded the machine was when they started.
    for name in ("busy_a", "busy_b", "clean", "clean_2"):
        found = [f for f in summarize(runs[name], warn=pytest.fail)["findings"] if f["kind"] == "straggler"]
        waits = cpu_waits(read_records(runs[name]))
        assert sorted(waits) == [0, 1], (name, "each rank logs its wait for a CPU (--cpu-wait)")
        unexplained = [(f["rank"], f["message"], starved_by(waits, f["rank"])) for f in found if not starved(f, waits)]
        assert unexplained == [], (name, unexplained)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("restart") / "run"
    finished(torchrun(path, "--hidden", "256", "--steps", "30", "--eval-every", "0", "--checkpoint-every", "10",
                      "--fail-rank", "1", "--fail-step", "15", "--fail-attempts", "1", "--resume",
                      "--timeout-s", "20", extra=("--max-restarts=1",)))
    return path


def test_goodput_of_a_run_restarted_after_a_failure(restarted: Path) -> None:
    summary = summarize(restarted, warn=pytest.fail)
    g = summary["goodput"]
    parts = ("productive_s", "init_s", "checkpoint_s", "eval_s", "lost_s", "restart_s")
    assert sum(g[k] for k in parts) <= g["wall_s"] + 1e-9
    assert g["restart_s"] > 0.0 and g["checkpoint_s"] > 0.0 and g["init_s"] > 0.0
    # Attempt 0 reached step 15 and failed; attempt 1 resumed after the step-10 checkpoint: steps 11-15
    # of attempt 0 were lost (with the failed step's wait for the dead peer).
    assert g["lost_s"] > 0.0 and g["productive_s"] > 0.0
    assert g["fraction"] == pytest.approx(g["productive_s"] / g["wall_s"])
    restart = next(f for f in summary["findings"] if f["kind"] == "restart")
    assert restart["step"] == 11 and restart["progress"] is True
    steps = {(p["rank"], p["attempt"]): p["final_step"] for p in summary["processes"]}
    assert steps == {(0, 0): 15, (1, 0): 15, (0, 1): 29, (1, 1): 29}
