"""``whatif`` on a 64-rank x 1,000-step pipeline run: the dependency-graph simulation at scale.

The run is tests/pipeline_sim.py's (the simulator with ground truth): ``--dp`` x ``--pp`` x ``--tp``
ranks (default 16 x 4 x 1 = 64), 1F1B over ``--microbatches`` (4), one slow worker, written as our
trace files and cached under ``--cache`` (written once: a few minutes). Then, each ``--repeat`` times:

* in process: ``load_run`` (no read cache), then ``whatif(run)`` (the ``typical`` method: every
  scenario of the answer, the worker pass included), timed apart, with the phases of the analysis
  (graph build, simulation) from the graph module;
* the CLI as users run it, ``otel-train whatif RUN --json``, with a cold read cache (``--no-cache``)
  and a warm one (the second run reads the cache the first wrote).

Prints one JSON object: machine load, sizes, times, S against the simulator's truth.

    .venv/bin/python benchmarks/whatif_scale.py [--steps 1000] [--cache /tmp/otel-train-whatif-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

from otel_train.analysis import graph  # noqa: E402
from otel_train.analysis.spans import load_run  # noqa: E402
from otel_train.analysis.whatif import _scenarios, has_mesh, whatif  # noqa: E402

CLI = Path(sys.executable).with_name("otel-train")


def generate(args: argparse.Namespace) -> tuple[Path, dict]:
    """The cached run and its truth (S and the culprit), written on first use."""
    import pipeline_sim

    name = f"dp{args.dp}pp{args.pp}tp{args.tp}mb{args.microbatches}s{args.steps}"
    run = Path(args.cache) / name
    truth_file = run / "truth.json"
    if not truth_file.exists():
        t = time.perf_counter()
        truth = pipeline_sim.write_job(run, dp=args.dp, pp=args.pp, tp=args.tp, steps=args.steps,
                                       microbatches=args.microbatches, schedule="1f1b", cause="worker", seed=1)
        truth_file.write_text(json.dumps({"slowdown": truth.slowdown, "top": truth.top,
                                          "written_s": time.perf_counter() - t}))
    return run, json.loads(truth_file.read_text())


def size_mb(run: Path) -> float:
    return sum(p.stat().st_size for p in (run / "structured_logs").rglob("*") if p.is_file()) / 1e6


def in_process(run: Path) -> dict:
    """load_run, then whatif, timed apart; the graph's size and the simulation's share."""
    t = time.perf_counter()
    loaded = load_run(run, cache=False)
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    out = whatif(loaded)
    t_whatif = time.perf_counter() - t
    group = loaded.groups()[0]
    t = time.perf_counter()
    g = graph.build(group)
    t_build = time.perf_counter() - t
    assert g is not None
    scen = _scenarios(g, not has_mesh(loaded))
    masks = np.ones((len({v.tobytes() for v in scen.values()}), g.fixed + 1), bool)
    t = time.perf_counter()
    graph.simulate(g, masks)
    t_sim = time.perf_counter() - t
    return {"load_s": t_load, "whatif_s": t_whatif, "graph_build_s": t_build, "simulate_s": t_sim,
            "scenarios": int(masks.shape[0]), "nodes": int(g.nodes[-1]), "edges": int(g.edges[-1]),
            "blocks": int(g.steps.size), "plans": len(g.plans), "slowdown": out["slowdown"],
            "top_rank": out["by_rank"][0]["rank"], "workers": out.get("workers")}


def cli(run: Path, *extra: str) -> float:
    t = time.perf_counter()
    done = subprocess.run([str(CLI), "whatif", str(run), "--json", *extra], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cache", default="/tmp/otel-train-whatif-scale")
    args = parser.parse_args()
    run, truth = generate(args)
    result = {"cpus": os.cpu_count(), "load_before": os.getloadavg()[0], "run_mb": round(size_mb(run), 1),
              "ranks": args.dp * args.pp * args.tp, "steps": args.steps, "truth": truth, "rounds": []}
    for _ in range(args.repeat):
        row = in_process(run)
        row["cli_cold_s"] = cli(run, "--no-cache")
        cli(run)  # fills the read cache
        row["cli_warm_s"] = cli(run)
        row["load_after"] = os.getloadavg()[0]
        result["rounds"].append(row)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
