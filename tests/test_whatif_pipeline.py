"""whatif on real pipeline jobs (issue 17, target "Real torchrun pipeline jobs"): gloo, 2 stages x 2
data-parallel (``examples/train_parallel.py --mode pp``, 1F1B over 4 microbatches), two runs: one slowed
rank (rank 1: stage 0, dp replica 1, +32 ms in every forward), one slowed stage (both ranks of stage 1,
+24 ms in every forward). ``whatif --method typical --json`` must name the culprit (by_rank top: the
slowed rank; by_dim pp top: the slowed stage), and each run's ideal step must be within 10 % of its
clean steps.

Each run is its own baseline: the fault hits every second step only (``--slow-every 2``: steps 1, 3,
5, ...), so the steps in between are clean steps of the same processes, interleaved with the faulty
ones; whatever load comes and goes meets both alike. No test here compares two runs' timings (a
clean run against a faulty one, a minute apart, failed a CI run: the other tests' load had moved
between them). That comparison, the issue's own wording of the target, is measured by
``benchmarks/whatif_pipeline.py``, with its figures in docs/analysis.md "Real pipeline jobs".

The stages wait on a pretend device (``--gpu-wait-ms 40``: 40 ms per microbatch forward, 80 ms per
backward, sleeping), so a step is mostly time that a busy two-core machine does not stretch; the
CPU work and the gloo transfers are a few ms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from step_times import step_ms
from typer.testing import CliRunner

from otel_train.cli import app

pytest.importorskip("torch.distributed")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_parallel.py"
STEPS = 16
COMMON = ("--mode", "pp", "--schedule", "1f1b", "--steps", str(STEPS), "--gpu-wait-ms", "40", "--slow-every", "2")
SLOW_RANK, SLOW_STAGE = 1, 1
RUNS = {
    "rank": ("--fault", "slow-stage", "--fault-rank", str(SLOW_RANK), "--slow-ms", "32"),
    "stage": ("--fault", "slow-stage", "--fault-stage", str(SLOW_STAGE), "--slow-ms", "24"),
}
SATURATED = 5.0
"""Above this load per CPU before the runs (other jobs saturate the machine far beyond what
``make test``'s two workers give) the slowed stage's culprit is skipped with the load. Before the
graph's rendezvous rule (a send that waited for its recv) the stage's culprit flipped at 2.7 - 5 per
CPU, stage 0's waiting sends charged to stage 0; since, it was right at 2.1 and 4.1
(docs/analysis.md "Real pipeline jobs")."""
TOLERANCE = 0.10


def _job(save_path: Path, args: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
           "--save-path", str(save_path), *COMMON, *args]
    proc = subprocess.Popen(cmd, cwd=save_path.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and its four ranks share the session started above
        out, _ = proc.communicate()
        pytest.fail(f"the pipeline job did not finish in 300 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]


def _whatif(path: Path) -> dict[str, Any]:
    done = CliRunner().invoke(app, ["whatif", str(path), "--method", "typical", "--json"])
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipeline")
    load = os.getloadavg()[0] / (os.cpu_count() or 1)  # before our runs add theirs
    out: dict[str, Any] = {"load": load}
    for name, args in RUNS.items():
        _job(root / name, args)
        out[name] = {"whatif": _whatif(root / name), "steps": step_ms(root / name)}
    return out


def _slowed(step: int) -> bool:
    return step % 2 == 1  # --slow-every 2


def _ideal_and_clean(run: dict[str, Any]) -> tuple[float, float]:
    """(the run's ideal step, its clean steps' measured step) in ms, medians over steps: the ideal of a
    step is its measured time / ``per_step`` (the replay reproduces the measured steps)."""
    ratio = run["whatif"]["per_step"]
    ideal = [ms / ratio[str(s)] for s, ms in run["steps"].items() if ratio.get(str(s))]
    clean = [ms for s, ms in run["steps"].items() if not _slowed(s)]
    return float(np.median(ideal)), float(np.median(clean))


@pytest.mark.parametrize("name", list(RUNS))
def test_the_run_replays_its_own_steps(runs: dict[str, Any], name: str) -> None:
    w = runs[name]["whatif"]
    assert w["method"] == "typical" and w["steps"] >= STEPS - 3
    assert w["step_ms"]["actual"] == pytest.approx(w["step_ms"]["measured"], rel=1e-3)
    assert sorted(w["by_dim"]) == ["dp", "pp"] and len(w["by_rank"]) == 4


def test_slowed_rank_is_the_top_rank(runs: dict[str, Any]) -> None:
    w = runs["rank"]["whatif"]
    assert w["by_rank"][0]["rank"] == SLOW_RANK, w["by_rank"]
    # (Its stage and replica lead by_dim too, but by 0.02 at times under load: not asserted.)


def test_slowed_stage_is_the_top_stage(runs: dict[str, Any]) -> None:
    w = runs["stage"]["whatif"]
    pp = {r["index"]: round(r["slowdown"], 3) for r in w["by_dim"]["pp"]}
    print(f"stage: by_dim.pp {pp}, top rank {w['by_rank'][0]['rank']}, load {runs['load']:.2f} per CPU")
    if runs["load"] > SATURATED:
        pytest.skip(f"other jobs kept {runs['load']:.1f} processes runnable per CPU when the runs started: "
                    "the stage's signal meets transfers the load stretched")
    assert max(w["by_dim"]["pp"], key=lambda r: r["slowdown"])["index"] == SLOW_STAGE, w["by_dim"]
    assert w["by_rank"][0]["rank"] in (2, 3), w["by_rank"]  # one of stage 1's two ranks


@pytest.mark.parametrize("name", list(RUNS))
def test_the_ideal_is_the_runs_clean_step(runs: dict[str, Any], name: str) -> None:
    run = runs[name]
    ideal, clean = _ideal_and_clean(run)
    slowed = float(np.median([ms for s, ms in run["steps"].items() if _slowed(s)]))
    w = run["whatif"]
    print(f"{name}: slowed steps {slowed:.1f} ms, clean steps {clean:.1f} ms, ideal {ideal:.1f} ms "
          f"({100 * (ideal / clean - 1):+.1f} %), S {w['slowdown']:.3f}, load {runs['load']:.2f} per CPU")
    assert slowed > clean and w["slowdown"] > 1.0  # the fault costs something, and whatif sees it
    assert ideal == pytest.approx(clean, rel=TOLERANCE), (
        f"{name}: ideal {ideal:.1f} ms vs the run's clean steps' {clean:.1f} ms (medians; load {runs['load']:.1f} per CPU)")
