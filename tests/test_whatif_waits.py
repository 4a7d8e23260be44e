"""whatif ``typical`` on untraced time (docs/analysis.md "Waits"), device-stream overlaps and comm ops it
cannot use (issue 42): hand-built runs whose answers are known by construction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import comm_attrs, declare

from otel_train import schema
from otel_train.analysis import graph_chain
from otel_train.analysis.graph_model import SNAP_MS
from otel_train.analysis.graph_ops import RankOps
from otel_train.analysis.spans import load_run
from otel_train.analysis.whatif import whatif
from otel_train.phases import FORWARD, OPTIMIZER, STEP

STEPS = 6
TRANSFER, OPT = 2.0, 3.0


def two_ranks(path: Path, fwd: tuple[float, float], resume: float = 0.0, extra: bool = False) -> Path:
    """Two ranks, each step: forward (``fwd[r]`` ms), an all_reduce over both, optimizer. Rank 1, done
    first, idles outside any span until ``resume`` ms after rank 0's forward ended (0: it waited for
    it, an untraced dependency), then both arrive at the all_reduce together. ``extra``: rank 0 also
    writes an all_reduce without ``comm.seq`` each step (an op the graph cannot match)."""
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    declare(procs)
    seq = 0
    for s in range(STEPS):
        begin = max(p.now_ms for p in procs)
        for p in procs:
            p.now_ms = begin
            p.set_step(s)
            p.start(STEP)
            p.start(FORWARD)
            p.advance(fwd[p.rank])
            p.end()
        arrive = begin + fwd[0] + resume
        for p in procs:
            p.now_ms = arrive
            p.start(schema.comm_span_name("all_reduce"), **comm_attrs("0", seq, 1 << 20))
            p.now_ms = arrive + TRANSFER
            p.end()
            p.start(OPTIMIZER)
            p.advance(OPT)
            p.end()
            p.end()
        seq += 1
    if extra:  # rank 0 begins one more all_reduce in the last step and never ends it (it hangs there)
        procs[0].set_step(STEPS - 1)
        procs[0].start(schema.comm_span_name("all_reduce"), **comm_attrs("0", seq, 1 << 20))
    for p in procs:
        p.shutdown()
    write_run(path, procs)
    return path


def typical(path: Path) -> dict[str, Any]:
    return whatif(load_run(path, warn=pytest.fail), method="typical")


def by_rank(out: dict[str, Any]) -> dict[int, float]:
    return {r["rank"]: r["slowdown"] for r in out["by_rank"]}


def test_a_wait_outside_spans_is_zero_in_the_ideal_and_charged_to_the_rank_waited_for(tmp_path: Path) -> None:
    """Issue 42's 2-rank run: rank 1 (forward 10 ms) idles 10 ms outside spans before the all_reduce,
    waiting for slow rank 0 (forward 20 ms). The published answer by construction: ideal forward the
    mean, 15 ms, the wait zero: (20 + 2 + 3) / (15 + 2 + 3) = 1.25; rank 0 alone as measured gives the
    whole step, rank 1 alone the ideal one. Before, S was 1.000 and rank 1 was charged like rank 0."""
    out = typical(two_ranks(tmp_path / "run", (20.0, 10.0)))
    truth = (20.0 + TRANSFER + OPT) / (15.0 + TRANSFER + OPT)
    assert out["slowdown"] == pytest.approx(truth, rel=0.03)
    assert out["step_ms"]["actual"] == pytest.approx(20.0 + TRANSFER + OPT, rel=1e-3)
    ranks = by_rank(out)
    assert ranks[0] == pytest.approx(truth, rel=0.03)  # charged
    assert ranks[1] == pytest.approx(1.0, abs=0.01)  # not charged: its idle time was rank 0's
    assert out["waits"] == STEPS  # one a step, rank 1's (the first step's is timed too: it only anchors the next)
    untraced = [r for r in out["by_phase"] if r["phase"] == "(untraced)"]
    assert not untraced or untraced[0]["slowdown"] == pytest.approx(1.0, abs=0.01)


def test_untraced_time_that_ends_at_no_op_end_stays_the_ranks_own(tmp_path: Path) -> None:
    """Rank 1 resumes 1 ms after rank 0's forward ended (beyond graph_model.WAIT_MS): no op end explains
    its idle time, so it is its own (the mean of its key in the ideal, as before), never a wait."""
    out = typical(two_ranks(tmp_path / "run", (20.0, 10.0), resume=1.0))
    assert out["waits"] == 0
    # Both ranks' untraced time before the all_reduce (1 and 11 ms) made typical, 6 ms: the ideal step
    # keeps the wait, as it did for every gap before issue 42 (the wait's own S is 1.25 above).
    assert out["slowdown"] == pytest.approx(1.0, abs=0.01)


def test_ops_that_cannot_be_used_are_counted_and_said(tmp_path: Path) -> None:
    out = typical(two_ranks(tmp_path / "run", (20.0, 10.0), extra=True))
    assert out["left_out"]["ops"] == 1
    assert "no end time" in out["left_out"]["why"]
    assert "left_out" not in typical(two_ranks(tmp_path / "clean", (20.0, 10.0)))


def _ops(leaves: list[tuple[float, float]], comm: list[tuple[float, float]]) -> RankOps:
    ls, le = (np.array([x[i] for x in leaves]) for i in (0, 1))
    cs, ce = (np.array([x[i] for x in comm]) for i in (0, 1))
    n, k = ls.size, cs.size
    z = np.zeros(n, np.int64)
    return RankOps(ls, le, z, z.copy(), cs, ce, np.zeros(k, np.int64), np.ones(k, np.int64),
                   np.arange(k, dtype=np.int64), np.zeros(k, bool), np.zeros(k, np.int64))


def test_device_stream_overlaps_are_snapped_not_detached_or_clustered() -> None:
    """A comm op that ends 10 us after the next compute span began, and one that begins 0.1 ms before
    the comm op before it ended (CUDA events on two streams): snapped. Before, the first was detached
    (its waiting turned into untraced time) and the second clustered with the first (replayed at a
    fixed offset). An overlap longer than graph_model.SNAP_MS stays what it is."""
    ro = _ops([(0.0, 5.0), (7.0, 12.0)], [(5.0, 6.0), (5.9, 6.5), (6.5, 7.01)])
    ch = graph_chain.chain(ro)
    assert ch.snapped == 2 and not ch.detached.any()
    assert list(ro.c_start) == [5.0, 6.0, 6.5] and list(ro.c_end) == [6.0, 6.5, 7.0]
    assert (ch.piece < 0).sum() == 3  # three clusters of one op each, not one of two
    far = _ops([(0.0, 5.0), (7.0, 12.0)], [(5.0, 6.0), (6.0 - SNAP_MS - 0.1, 7.0)])
    ch = graph_chain.chain(far)
    assert ch.snapped == 0 and (ch.piece < 0).sum() == 1  # a real overlap: one cluster


def test_the_text_says_what_was_left_out_and_how_many_waits(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from otel_train.cli import app

    path = two_ranks(tmp_path / "run", (20.0, 10.0), extra=True)
    done = CliRunner().invoke(app, ["whatif", str(path), "--method", "typical", "--no-cache"])
    assert done.exit_code == 0, done.output
    assert f"Untraced waits on another rank's op: {STEPS}" in done.output
    assert "Left out of the replay: 1 comm ops (1 with no end time" in done.output


def test_waits_matched_a_chunk_at_a_time_give_the_same_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """graph_joins.waits matches gaps WAIT_CHUNK at a time (bounded memory on a large run): the answer
    is the same as with every gap at once, to the last bit."""
    from pipeline_sim import Recording, write_job

    from otel_train.analysis import graph_joins

    write_job(tmp_path / "run", dp=2, pp=4, tp=1, steps=4, microbatches=8, schedule="1f1b", cause="worker", seed=3,
              recording=Recording(untraced_recv=True))
    whole = typical(tmp_path / "run")
    monkeypatch.setattr(graph_joins, "WAIT_CHUNK", 7)
    chunked = typical(tmp_path / "run")
    assert whole["waits"] > 7 and chunked == whole
