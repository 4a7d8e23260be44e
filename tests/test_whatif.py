"""What-if arithmetic on synthetic synchronised runs with exactly known timings."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from sync_sim import Times, base, simulate

from otel_train.analysis.spans import load_run
from otel_train.analysis.whatif import UNTRACED, sync_table, whatif
from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER, STEP

def run_of(tmp_path: Path, times: Times, world: int = 4, steps: int = 21, **proc: object) -> dict:
    procs = [Proc(rank=r, world_size=world, **proc) for r in range(world)]  # type: ignore[arg-type]
    simulate(procs, steps, times)
    write_run(tmp_path, procs)
    return whatif(load_run(tmp_path, warn=pytest.fail))


def by(rows: list[dict], key: str) -> dict:
    return {r[key]: r["slowdown"] for r in rows}


def test_a_slow_rank_costs_exactly_its_excess(tmp_path: Path) -> None:
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        if rank == 3:
            t[DATA_FETCH] = 15.0
        return t

    out = run_of(tmp_path, times)
    assert out["steps"] == 20
    assert out["step_ms"]["actual"] == pytest.approx(70.0, abs=1e-3)  # 30 tail + 5 + 15 + 20
    assert out["step_ms"]["measured"] == pytest.approx(70.0, abs=1e-3)
    assert out["step_ms"]["ideal"] == pytest.approx(60.0, abs=1e-3)
    assert out["slowdown"] == pytest.approx(70 / 60, rel=1e-4)
    ranks = by(out["by_rank"], "rank")
    assert ranks[3] == pytest.approx(70 / 60, rel=1e-4) and out["by_rank"][0]["rank"] == 3
    assert all(ranks[r] == pytest.approx(1.0, abs=1e-4) for r in (0, 1, 2))
    phases = by(out["by_phase"], "phase")
    assert phases[DATA_FETCH] == pytest.approx(70 / 60, rel=1e-4)
    assert phases[FORWARD] == phases[OPTIMIZER] == phases[BACKWARD] == pytest.approx(1.0, abs=1e-4)
    top = out["by_rank_phase"][0]
    assert (top["rank"], top["phase"]) == (3, DATA_FETCH)
    assert top["cost_ms"] == pytest.approx(10.0, abs=1e-3) and top["cost_pct"] == pytest.approx(100 / 7, rel=1e-4)
    assert next(p for p in out["by_phase"] if p["phase"] == BACKWARD)["collective"] is True


def test_step_time_is_the_slowest_rank_not_a_sum(tmp_path: Path) -> None:
    # Rank 3 is 10 ms late every step; rank 1 is 8 ms late on even steps only: it hides behind rank 3.
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        if rank == 3:
            t[DATA_FETCH] = 15.0
        if rank == 1 and step % 2 == 0:
            t[FORWARD] = 28.0
        return t

    out = run_of(tmp_path, times)
    ranks, phases = by(out["by_rank"], "rank"), by(out["by_phase"], "phase")
    assert out["step_ms"]["actual"] == pytest.approx(70.0, abs=1e-3)
    assert ranks[1] == pytest.approx(1.0, abs=1e-4)  # making rank 1 typical alone gains nothing
    # Rank 3 typical: rank 1's even steps (68 ms) now set the pace, odd steps take 60 ms.
    assert ranks[3] == pytest.approx(70 / 64, rel=1e-3)
    assert phases[DATA_FETCH] == pytest.approx(70 / 64, rel=1e-3)
    assert phases[FORWARD] == pytest.approx(1.0, abs=1e-4)  # the median over four ranks is 20 ms
    assert out["step_ms"]["ideal"] == pytest.approx(60.0, abs=1e-3)


def test_tails_and_clock_skew_between_hosts(tmp_path: Path) -> None:
    # Two hosts of three ranks whose clocks differ by 250 ms: the collective ends line the hosts up
    # again. Rank 2 leaves every all-reduce 4 ms after the others (its tail): its own cost, in backward.
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        t["tail"] = 34.0 if rank == 2 else 30.0
        return t

    procs = [Proc(rank=r, world_size=6, host=f"node{r // 3}", t0=1_700_000_000.0 + 0.25 * (r // 3))
             for r in range(6)]
    simulate(procs, 21, times)
    write_run(tmp_path, procs)
    out = whatif(load_run(tmp_path, warn=pytest.fail))
    assert out["step_ms"]["actual"] == pytest.approx(64.0, abs=1e-3)  # 34 + 5 + 20 + 5
    ranks = by(out["by_rank"], "rank")
    assert ranks[2] == pytest.approx(64 / 60, rel=1e-4)
    assert all(ranks[r] == pytest.approx(1.0, abs=1e-4) for r in (0, 1, 3, 4, 5))
    assert by(out["by_phase"], "phase")[BACKWARD] == pytest.approx(64 / 60, rel=1e-4)


def test_two_ranks_ideal_is_the_faster_rank(tmp_path: Path) -> None:
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        t[DATA_FETCH] = 25.0 if rank == 1 else 5.0 + (step % 3)
        return t

    out = run_of(tmp_path, times, world=2)
    clean = 30.0 + 5.0 + 1.0 + 20.0 + 5.0  # the faster rank's mean data_fetch is 6 ms
    assert out["step_ms"]["actual"] == pytest.approx(80.0, abs=1e-3)
    assert out["step_ms"]["ideal"] == pytest.approx(clean, abs=0.05)
    assert by(out["by_rank"], "rank")[1] == pytest.approx(80.0 / clean, rel=1e-3)
    assert by(out["by_rank"], "rank")[0] == pytest.approx(1.0, abs=1e-4)


def test_an_op_outside_the_steps_that_overlaps_them_is_not_a_phase(tmp_path: Path) -> None:
    # Seen in CI: an init-time all_gather whose Flight Recorder entry found its end 848 ms late, top level
    # and overlapping steps 0 - 5, became a column of rank 0 with (untraced) -847 ms in one interval; the
    # two-rank ideal took one column from each rank and fell 20 ms below every rank's own step.
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        t[DATA_FETCH] = 25.0 if rank == 1 else 5.0
        return t

    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    simulate(procs, 12, times)
    p = procs[0]
    p.set_step(None)  # type: ignore[arg-type]
    p.now_ms, saved = 50.0, p.now_ms
    p.start("comm.all_gather", **{"comm.group": "0", "comm.seq": 1})
    p.now_ms = 5 * 80.0 + 10.0  # its end lies inside step 5's forward
    p.end()
    p.now_ms = saved
    p.shutdown()
    write_run(tmp_path, procs)
    run = load_run(tmp_path, warn=pytest.fail)
    table = sync_table(run.processes)
    assert table is not None and not any(name.startswith("comm.") for name in table.phases)
    assert (table.work[1:] >= -0.01).all()  # every rank's columns split its interval, none below zero
    out = whatif(run)
    assert out["step_ms"]["ideal"] == pytest.approx(30.0 + 5.0 + 20.0 + 5.0, abs=0.05)


def test_untraced_time_and_windows(tmp_path: Path) -> None:
    # Rank 0's optimizer takes 6 ms longer from step 10 on.
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        if rank == 0 and step >= 10:
            t[OPTIMIZER] = 11.0
        return t

    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    simulate(procs, 21, times)
    write_run(tmp_path, procs)
    run = load_run(tmp_path)
    late = whatif(run, window=(11, 20))
    assert late["steps"] == 9 and late["step_ms"]["actual"] == pytest.approx(66.0, abs=1e-3)
    assert by(late["by_phase"], "phase")[OPTIMIZER] == pytest.approx(66 / 60, rel=1e-4)
    early = whatif(run, window=(0, 9))
    assert early["step_ms"]["actual"] == pytest.approx(60.0, abs=1e-3) and early["slowdown"] == pytest.approx(1.0)
    assert UNTRACED in by(early["by_phase"], "phase")


def test_a_single_rank_or_no_collective_has_nothing_to_compare(tmp_path: Path) -> None:
    (p,) = [Proc(rank=0, world_size=1)]
    p.steps(range(5))
    p.shutdown()
    write_run(tmp_path / "one", [p])
    out = whatif(load_run(tmp_path / "one"))
    assert out["steps"] == 0 and out["slowdown"] is None and out["by_rank"] == []
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(12), {DATA_FETCH: 5.0, FORWARD: 20.0})  # no backward: nothing says where ranks wait
        p.shutdown()
    write_run(tmp_path / "nosync", procs)
    assert whatif(load_run(tmp_path / "nosync"))["steps"] == 0
    out = whatif(load_run(tmp_path / "nosync"), sync=(FORWARD,))  # unless the user names the collective
    assert out["steps"] == 11 and out["sync"] == [FORWARD]


def test_a_collective_span_without_a_step_is_left_out(tmp_path: Path) -> None:
    # Found by fuzzing: a backward span outside any step left an empty key column, and whatif raised.
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.start(BACKWARD)  # before the first set_step: no step on its records
        p.advance(4)
        p.end()
    write_run(tmp_path / "stepless", procs)
    assert whatif(load_run(tmp_path / "stepless"))["steps"] == 0
    for p in procs:
        p.steps(range(6), {FORWARD: 2.0, BACKWARD: 3.0})
        p.shutdown()
    write_run(tmp_path / "mixed", procs)
    assert whatif(load_run(tmp_path / "mixed"))["steps"] == 5  # the stepless span is simply not a step


def test_whatif_cli_json_text_and_exit_codes(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from otel_train.cli import app

    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        if rank == 3:
            t[DATA_FETCH] = 15.0
        return t

    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    simulate(procs, 21, times)
    write_run(tmp_path / "run", procs, garbage={3: b"{not json"})
    result = CliRunner().invoke(app, ["whatif", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"step_ms", "slowdown", "by_rank", "by_phase", "steps"}
    assert set(out["step_ms"]) >= {"actual", "ideal"} and out["steps"] == 20
    assert all(set(r) >= {"rank", "slowdown"} for r in out["by_rank"])
    assert all(set(r) >= {"phase", "slowdown"} for r in out["by_phase"])
    assert "skipped malformed line" in result.stderr
    text = CliRunner().invoke(app, ["whatif", str(tmp_path / "run")])
    assert text.exit_code == 0 and "rank 3's data_fetch" in text.stdout and "14.3 %" in text.stdout
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(app, ["whatif", str(tmp_path / "empty")])
    assert empty.exit_code == 2 and empty.stderr.startswith("error:") and len(empty.stderr.splitlines()) == 1


def _unsynchronized(procs: list[Proc], steps: int) -> None:
    """Data-parallel-looking steps whose backward waits for nobody: each rank leaves it after its own
    30 ms, and rank r's forward takes 20 + 4 r ms, so the ranks drift apart by 4 ms a step."""
    for s in range(steps):
        for p in procs:
            p.set_step(s)
            p.start(STEP)
            for name, ms in ((DATA_FETCH, 5.0), (FORWARD, 20.0 + 4.0 * p.rank), (BACKWARD, 30.0), (OPTIMIZER, 5.0)):
                p.start(name)
                p.advance(ms)
                p.end()
            p.end()
    for p in procs:
        p.shutdown()


@pytest.mark.parametrize("method", ["peers", "typical"])
def test_a_sync_phase_that_does_not_synchronise_is_named_not_replayed(tmp_path: Path, method: str) -> None:
    """The benchmark's synthetic run had independent ranks: whatif answered an ideal of -438 ms. A
    group whose collectives do not make every rank wait for the last is left out and named."""
    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    _unsynchronized(procs, 30)
    write_run(tmp_path, procs)
    out = whatif(load_run(tmp_path, warn=pytest.fail), method=method)
    assert out["steps"] == 0 and out["step_ms"]["ideal"] is None and out["slowdown"] is None
    (u,) = out["unsynchronized"]
    assert u["ranks"] == [0, 1, 2, 3] and u["sync"] == [BACKWARD]
    assert u["share"] > 0.5 and u["early_ms"] > 4.0


def test_synchronised_runs_have_nothing_left_out(tmp_path: Path) -> None:
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        t[FORWARD] = 20.0 + 4.0 * rank  # the same drift as above, absorbed by the all-reduce
        return t

    for method in ("peers", "typical"):
        out = run_of(tmp_path / method, times) if method == "peers" else _typical_of(tmp_path / method, times)
        assert out["unsynchronized"] == [] and out["steps"] == 20
        assert out["step_ms"]["ideal"] > 0


def _typical_of(tmp_path: Path, times: Times) -> dict:
    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    simulate(procs, 21, times)
    write_run(tmp_path, procs)
    return whatif(load_run(tmp_path, warn=pytest.fail), method="typical")


def test_the_cli_says_why_a_group_is_left_out(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from otel_train.cli import app

    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    _unsynchronized(procs, 30)
    write_run(tmp_path / "run", procs)
    text = CliRunner().invoke(app, ["whatif", str(tmp_path / "run"), "--no-cache"])
    assert text.exit_code == 0, text.output
    said = " ".join(text.stdout.split())  # the console wraps at its width
    assert said.startswith("What-if left out ranks 0-3: backward does not synchronise them")
    assert "--sync names the phase" in said.split("What-if:")[0] and "no steps to replay" in said
