"""Goodput: the wall time split into productive steps, init, checkpoint, eval, lost work and restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run

from otel_train.analysis.goodput import goodput
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize
from otel_train.phases import CHECKPOINT, EVAL, FORWARD, STEP

T0 = 1_700_000_000.0


def _step(p: Proc, step: int, checkpoint_ms: float = 0.0) -> None:
    """A 100 ms step (plus a checkpoint inside it when asked)."""
    p.set_step(step)
    p.start(STEP)
    p.advance(1.0)
    p.start(FORWARD)
    p.advance(98.0)
    p.end()
    if checkpoint_ms:
        p.start(CHECKPOINT)
        p.advance(checkpoint_ms)
        p.end()
    p.advance(1.0)
    p.end()


def _restarted_run(tmp_path: Path) -> Path:
    first = [Proc(rank=r, attempt=0, stamp="20240101-000000", t0=T0) for r in range(2)]
    second = [Proc(rank=r, attempt=1, stamp="20240101-000003", t0=T0 + 3.0) for r in range(2)]
    for p in first:
        p.advance(1000.0)  # imports, process group, model build
        for s in range(10):
            _step(p, s, checkpoint_ms=50.0 if s == 4 else 0.0)
        p.fail(10, FORWARD, "RuntimeError", "injected failure")  # 3 ms, then the process is gone
    for p in second:
        p.advance(500.0)
        for s in range(5, 20):  # resumed from the step-4 checkpoint: steps 5-10 are done again
            _step(p, s)
        p.start(EVAL)
        p.advance(200.0)
        p.end()
        p.shutdown()
    write_run(tmp_path, first + second)
    return tmp_path


def test_goodput_of_a_restarted_run_has_exact_parts(tmp_path: Path) -> None:
    g = summarize(_restarted_run(tmp_path), warn=pytest.fail)["goodput"]
    expected = {
        "wall_s": 5.201,
        "productive_s": 0.500 + 1.500,  # attempt 0's steps 0-4 less the checkpoint, attempt 1's 5-19
        "init_s": 1.000 + 0.500,
        "checkpoint_s": 0.050,
        "eval_s": 0.200,
        "lost_s": 0.500 + 0.003,  # steps 5-9 and the failed step 10, all redone
        "restart_s": 3.000 - 2.053,
        "other_s": 0.001,  # shutdown
    }
    for key, value in expected.items():
        assert g[key] == pytest.approx(value, abs=2e-5), key
    assert g["fraction"] == pytest.approx(2.0 / 5.201, rel=1e-4)


def test_goodput_parts_never_exceed_the_wall_time(tmp_path: Path) -> None:
    # Ranks out of step with each other, overlapping checkpoints and steps: each moment counts once.
    procs = [Proc(rank=r, world_size=3, t0=T0 + 0.0137 * r) for r in range(3)]
    for p in procs:
        p.advance(100.0)
        for s in range(20):
            _step(p, s, checkpoint_ms=30.0 * p.rank if s % 5 == 0 else 0.0)
        p.shutdown()
    write_run(tmp_path, procs)
    g = summarize(tmp_path)["goodput"]
    parts = sum(g[k] for k in ("productive_s", "init_s", "checkpoint_s", "eval_s", "lost_s", "restart_s", "other_s"))
    assert parts == pytest.approx(g["wall_s"], abs=1e-9)
    assert g["lost_s"] == g["restart_s"] == 0.0 and 0.0 < g["fraction"] < 1.0
    assert g["init_s"] == pytest.approx(0.100, abs=1e-5)  # the first rank's start to the first step anywhere


def test_goodput_of_an_empty_run(tmp_path: Path) -> None:
    (p,) = [Proc(rank=0, world_size=1)]
    write_run(tmp_path, [p])
    g = goodput(load_run(tmp_path))
    assert g["wall_s"] == 0.0 and g["fraction"] is None and g["productive_s"] == 0.0


def test_goodput_in_summarize_json_and_text(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from otel_train.cli import app

    run = _restarted_run(tmp_path)
    result = CliRunner().invoke(app, ["summarize", str(run), "--json"])
    assert result.exit_code == 0, result.output
    g = json.loads(result.stdout)["goodput"]
    assert set(g) >= {"wall_s", "productive_s", "fraction", "init_s", "checkpoint_s", "eval_s", "lost_s", "restart_s"}
    text = CliRunner().invoke(app, ["summarize", str(run)]).stdout
    assert "Goodput: 38.5 % of 5.2 s wall time was productive" in text and "restart downtime" in text
