"""``whatif`` on a 64-rank x 1,000-step pipeline run: the dependency-graph simulation at scale.

The run is tests/pipeline_sim.py's (the simulator with ground truth): ``--dp`` x ``--pp`` x ``--tp``
ranks (default 16 x 4 x 1 = 64), 1F1B over ``--microbatches`` (4), one slow worker, written as our
trace files and cached under ``--cache`` (written once: a few minutes). Then, each ``--repeat`` times:

* the CLI as users run it, ``otel-train whatif RUN --json``, with a cold read cache (``--no-cache``)
  and a warm one (the second run reads the cache the first wrote);
* in process: ``load_run`` (no read cache; then with the warm one), then ``whatif(run)`` (the
  ``typical`` method: every scenario of the answer, the worker pass included), timed apart, with the
  phases of the analysis (clock estimate, graph build, simulation) from the graph module.

Every time is [wall, CPU] seconds (CPU: user + system of the process, or of the CLI child): on a
machine other work keeps loaded, the wall is several times the CPU.

Prints one JSON object: machine load, sizes, times, S against the simulator's truth.

    .venv/bin/python benchmarks/whatif_scale.py [--steps 1000] [--cache /tmp/otel-train-whatif-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

from otel_train.analysis import graph  # noqa: E402
from otel_train.analysis.spans import load_run  # noqa: E402
from otel_train.analysis.whatif import _clock, _scenarios, has_mesh, whatif  # noqa: E402

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


class Timer:
    """Wall and CPU seconds of a block (CPU: this process's user + system time; on a loaded machine
    the wall is several times the CPU, which is what a quiet machine would come near)."""

    def __enter__(self) -> "Timer":
        self.w, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.w, time.process_time() - self.c


def in_process(run: Path) -> dict:
    """load_run, then whatif, timed apart; the graph's size and the simulation's share."""
    with Timer() as t_load:
        loaded = load_run(run, cache=False)
    with Timer() as t_warm:
        load_run(run)  # the read cache (written by the CLI's first run)
    with Timer() as t_whatif:
        out = whatif(loaded)
    group = loaded.groups()[0]
    with Timer() as t_clock:
        clock = _clock(loaded)
    with Timer() as t_build:
        g = graph.build(group, clock)
    assert g is not None
    scen = _scenarios(g, not has_mesh(loaded))
    masks = np.ones((len({v.tobytes() for v in scen.values()}), g.fixed + 1), bool)
    with Timer() as t_sim:
        graph.simulate(g, masks)
    times = {k: (round(t.wall, 2), round(t.cpu, 2)) for k, t in
             (("load", t_load), ("load_warm_cache", t_warm), ("whatif", t_whatif), ("clock", t_clock),
              ("graph_build", t_build), ("simulate", t_sim))}
    return {"wall_cpu_s": times, "scenarios": int(masks.shape[0]), "nodes": int(g.nodes[-1]),
            "edges": int(g.edges[-1]), "blocks": int(g.steps.size), "plans": len(g.plans),
            "levels": max(len(p.levels) for p in g.plans.values()), "slowdown": out["slowdown"],
            "top_rank": out["by_rank"][0]["rank"], "workers": out.get("workers"), "shares": out["shares"]}


def cli(run: Path, *extra: str) -> tuple[float, float]:
    """Wall and CPU seconds (the child's user + system) of one ``otel-train whatif --json``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([str(CLI), "whatif", str(run), "--json", *extra], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return round(time.perf_counter() - t, 2), round(cpu, 2)


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
        row: dict = {"cli_cold_wall_cpu_s": cli(run, "--no-cache")}
        cli(run)  # fills the read cache
        row["cli_warm_wall_cpu_s"] = cli(run)
        row.update(in_process(run))
        row["load_after"] = os.getloadavg()[0]
        result["rounds"].append(row)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
