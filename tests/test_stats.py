"""Stats helpers, the DataFrame view, and golden runs written by the real SDK (in and across processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from analysis_fixtures import Proc, write_run

from otel_train.analysis.frame import to_dataframe
from otel_train.analysis.stats import compute_stats, peer_medians, peer_table, quantiles, stats
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize
from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER


def test_quantiles_interpolate_linearly_and_peer_medians_exclude_self() -> None:
    assert quantiles(np.array([10.0, 1.0, 3.0, 2.0, 4.0]), (0.5, 0.95)) == pytest.approx([3.0, 8.8])
    assert np.isnan(quantiles(np.empty(0), (0.5,))[0])
    m = np.array([[1.0, 2.0, 3.0, 10.0], [5.0, np.nan, 7.0, 7.0], [1.0, np.nan, np.nan, np.nan]])
    expected = [[3.0, 3.0, 2.0, 2.0], [7.0, np.nan, 6.0, 6.0], [np.nan] * 4]
    assert np.allclose(peer_medians(m), expected, equal_nan=True)


def test_peer_table_uses_the_median_of_the_others(tmp_path: Path) -> None:
    procs = [Proc(rank=r, world_size=3) for r in range(3)]
    for p in procs:
        p.steps(range(2), {FORWARD: 10.0 * (p.rank + 1)})
        p.shutdown()
    write_run(tmp_path, procs)
    run = load_run(tmp_path)
    table = peer_table(run.processes, FORWARD)
    assert table.steps.tolist() == [0, 1]
    assert table.durs[0].tolist() == pytest.approx([10.0, 20.0, 30.0])
    assert table.peers[0].tolist() == pytest.approx([25.0, 20.0, 15.0])


def test_stats_scores_and_idle(tmp_path: Path) -> None:
    procs = [Proc(rank=r, world_size=3) for r in range(3)]
    for p in procs:
        fetch = 30.0 if p.rank == 2 else 10.0
        p.steps(range(8), {DATA_FETCH: fetch, FORWARD: 20.0, BACKWARD: 40.0, OPTIMIZER: 5.0})
        p.shutdown()
    write_run(tmp_path, procs)
    result = stats(tmp_path)
    scores = {(s["rank"], s["phase"]): s["score"] for s in result["straggler_scores"]}
    assert scores[(2, DATA_FETCH)] == pytest.approx(3.0)
    assert scores[(0, DATA_FETCH)] == pytest.approx(1 / 2)  # peers: 10 and 30 -> median 20
    assert scores[(1, FORWARD)] == pytest.approx(1.0)
    steps = [r for r in result["steps"] if r["rank"] == 2]
    assert len(steps) == 8 and all(r["idle_ms"] == pytest.approx(5.0) for r in steps)
    assert steps[0]["phases"][DATA_FETCH] == pytest.approx(30.0)
    assert compute_stats(load_run(tmp_path)) == result


def test_dataframe_has_one_row_per_span(tmp_path: Path) -> None:
    procs = [Proc(rank=r) for r in range(2)]
    for p in procs:
        p.steps(range(3))
        p.stop_inside(3, [FORWARD])
    write_run(tmp_path, procs)
    frame = to_dataframe(tmp_path)
    assert len(frame) == 2 * (3 * 5 + 2)
    open_rows = frame[frame["status"] == "open"]
    assert len(open_rows) == 4 and open_rows["dur_ms"].isna().all()
    fwd = frame[(frame["name"] == FORWARD) & (frame["status"] == "ok")]
    assert fwd["dur_ms"].round(3).eq(20.0).all()
    assert to_dataframe(tmp_path, ranks={1}, steps=(1, 1))["rank"].unique().tolist() == [1]


def test_golden_run_through_the_sdk_in_process(tmp_path: Path) -> None:
    import otel_train as ot

    ot.init(enabled=True, save_path=str(tmp_path))
    try:
        for step in range(5):
            with ot.training_step(step):
                with ot.log_trace_span(DATA_FETCH):
                    time.sleep(0.001)
                try:
                    with ot.log_trace_span(FORWARD):
                        if step == 3:
                            raise ValueError("bad batch")
                except ValueError:
                    assert step == 3
                ot.log_trace_scalar({"loss": 1.0 / (step + 1)})
    finally:
        ot.shutdown()
    summary = summarize(tmp_path, warn=pytest.fail)
    (proc,) = summary["processes"]
    assert (proc["final_step"], proc["open_spans"], proc["last_event"]) == (4, [], "process_end")
    assert [(f["kind"], f["rank"], f["phase"], f["step"]) for f in summary["findings"]] == [("error", 0, FORWARD, 3)]
    counts = {p["name"]: p["count"] for p in summary["phases"]}
    assert counts == {"step": 5, DATA_FETCH: 5, FORWARD: 5}


_WORKER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    import otel_train as ot

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ot.init(enabled=True, save_path=sys.argv[1])
    x = torch.ones(4)
    for step in range(14):
        with ot.training_step(step):
            with ot.log_trace_span("data_fetch"):
                if rank == 1 and step == 13:
                    open(sys.argv[2], "w").close()
                    time.sleep(600)  # the stuck dataloader
                time.sleep(0.03 if rank == 1 else 0.002)
            with ot.log_trace_span("forward"):
                time.sleep(0.002)
            with ot.log_trace_span("backward"):
                dist.all_reduce(x)  # waits for the slow rank
    ot.shutdown()
    """
)


@pytest.mark.timeout(120)
def test_golden_multi_process_hang_and_straggler_with_real_collectives(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    marker = tmp_path / "stuck"
    run = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(run), str(marker)], env={**env, "RANK": str(r)})
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            alive = all(p.poll() is None for p in procs)
            assert time.monotonic() < deadline and alive, f"workers did not get there: {[p.poll() for p in procs]}"
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is now blocked in the all-reduce of step 13
        procs[1].send_signal(signal.SIGTERM)  # the launcher's SIGTERM: shutdown marks open spans incomplete
        procs[1].wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # rank 0 sits in C++ code: only SIGKILL ends it, leaving its spans open
            p.wait(30)
    summary = summarize(run, warn=pytest.fail)
    kinds = [(f["kind"], f["rank"], f["phase"], f["step"]) for f in summary["findings"]]
    assert kinds[0] == ("hang", 1, DATA_FETCH, 13), summary["findings"]
    assert ("straggler", 1, DATA_FETCH) in [(k, r, ph) for k, r, ph, _ in kinds]
    assert all(r == 1 for _, r, _, _ in kinds), "rank 0 only waited: it is no culprit"
    by_rank = {p["rank"]: p for p in summary["processes"]}
    assert by_rank[1]["open_spans"] == ["step", DATA_FETCH] and by_rank[1]["ended_cleanly"]
    # Rank 0 was blocked in backward's all-reduce (its comm.all_reduce span open too once the recorder
    # had written its start). Either it sat there until SIGKILL, or gloo failed it when rank 1 went away
    # (a victim's error after the culprit stopped, so no finding) and the error closed its spans from the
    # inside out, as far as it got before the SIGKILL: whatever is still open is a prefix of that stack.
    assert by_rank[0]["final_step"] == 13
    stack = ["step", BACKWARD, "comm.all_reduce"]
    assert by_rank[0]["open_spans"] in [stack[:n] for n in range(len(stack) + 1)]


def test_binomial_tail_matches_exact_sums() -> None:
    import math
    from fractions import Fraction

    from otel_train.analysis.stats import binom_sf, sign_test

    for n, k, p in ((20, 15, 0.5), (10, 3, 0.1), (57, 40, 0.5), (1, 1, 0.5), (300, 170, 0.5)):
        q = Fraction(p).limit_denominator(1000)
        exact = sum(Fraction(math.comb(n, i)) * q**i * (1 - q) ** (n - i) for i in range(k, n + 1))
        assert binom_sf(k, n, p) == pytest.approx(float(exact), rel=1e-9)
    assert sign_test(10, 10) == pytest.approx(1 / 1024)  # ten slow steps out of ten
    assert binom_sf(0, 5) == 1.0 and binom_sf(6, 5) == 0.0
    assert 0.0 < binom_sf(3000, 4000) < 1e-200  # no underflow to a wrong 0 before it is tiny


def test_mann_whitney_matches_known_values_and_exhaustive_permutations() -> None:
    import itertools

    from otel_train.analysis.stats import mann_whitney

    # scipy's documented example (mannwhitneyu(..., method="asymptotic")): U = 17, p = 0.11134688653314041.
    males, females = np.array([19.0, 22, 16, 29, 24]), np.array([20.0, 11, 17, 12])
    u, p = mann_whitney(females, males)
    assert u == 17.0 and p == pytest.approx(0.11134688653314041, rel=1e-9)
    # Larger samples: the normal approximation is close to the exact permutation p-value.
    rng = np.random.default_rng(3)
    a, b = rng.lognormal(0.0, 0.6, 8), rng.lognormal(0.5, 0.6, 8)
    both = np.concatenate([a, b])
    observed = abs(np.median(b) - np.median(a))
    u_obs, p_approx = mann_whitney(a, b)
    center = 8 * 8 / 2
    extreme = total = 0
    for idx in itertools.combinations(range(16), 8):
        mask = np.zeros(16, bool)
        mask[list(idx)] = True
        u_perm, _ = mann_whitney(both[~mask], both[mask])
        extreme += abs(u_perm - center) >= abs(u_obs - center)
        total += 1
    assert observed > 0 and p_approx == pytest.approx(extreme / total, abs=0.01)
    # Ties get average ranks; all tied means no evidence at all.
    assert mann_whitney(np.ones(5), np.ones(7))[1] == 1.0
    assert np.isnan(mann_whitney(np.empty(0), np.ones(3))[1])


def test_student_t_matches_its_tables_and_its_own_integral() -> None:
    from otel_train.analysis.stats import incomplete_beta, student_t_isf, student_t_sf

    # Two-sided critical values from the standard t table (df, two-sided p, t).
    for df, p, t in [(1, 0.05, 12.706), (2, 0.01, 9.925), (4, 0.01, 4.604), (10, 0.05, 2.228), (30, 0.01, 2.750)]:
        assert student_t_isf(p / 2, df) == pytest.approx(t, abs=1e-3)
        assert 2 * student_t_sf(t, df) == pytest.approx(p, rel=2e-3)
    assert student_t_sf(0.0, 5) == 0.5 and student_t_sf(-1.3, 7) == pytest.approx(1 - student_t_sf(1.3, 7))
    # The density integrated by the trapezoid rule gives the same tail (df = 3, t = 1.5).
    x = np.linspace(1.5, 400.0, 2_000_001)
    dens = 2.0 / (np.pi * np.sqrt(3.0)) / (1 + x * x / 3.0) ** 2  # Student's t density at df = 3
    assert student_t_sf(1.5, 3) == pytest.approx(float(np.trapezoid(dens, x)), rel=1e-4)
    assert incomplete_beta(0.3, 2.0, 3.0) == pytest.approx(0.3483, abs=1e-4)  # I_0.3(2, 3), by hand: 0.3483
    assert incomplete_beta(0.0, 2.0, 3.0) == 0.0 and incomplete_beta(1.0, 2.0, 3.0) == 1.0
