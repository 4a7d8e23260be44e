"""Run-level answers: whatif and diff timed beside DuckDB, and their accuracy on real torchrun runs.

Parts (``--parts``, default all):

* ``timing``: on the synthetic 16 ranks x 4000 steps run of ``analysis_throughput.py`` (same
  generator, same cache), interleaved rounds of the DuckDB group-by query, ``whatif`` and
  ``diff`` (the run against itself: two runs read), in process and as the CLI;
* ``whatif``: pairs of real 2-rank torchrun runs, clean and with rank 1 30 ms slower in data_fetch
  on every step: whatif's ideal step vs the clean run's measured step, and its top-rank slowdown
  vs the measured (straggler / clean) ratio; ``--gpu-wait-ms 50`` steps (most of the step waits
  without CPU, as on a GPU) side by side and one after the other, and CPU-bound steps;
* ``stragglers``: clean 2-rank runs beside a busy-loop process, counting straggler findings;
* ``diff``: 200-step runs side by side, clean vs rank 1's forward 10 % slower (detections), and
  clean vs clean (false findings).

    .venv/bin/python benchmarks/run_answers.py [--parts timing,whatif,stragglers,diff] [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from analysis_throughput import cli, duckdb_query, generate, timed

from otel_train.analysis.diff import diff_runs
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize
from otel_train.analysis.whatif import whatif

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
SMALL = ("--hidden", "128", "--batch-size", "32", "--eval-every", "0", "--checkpoint-every", "0")
STEADY = ("--hidden", "128", "--batch-size", "32", "--eval-every", "0", "--checkpoint-every", "0",
          "--gpu-wait-ms", "50")
CPU_BOUND = ("--hidden", "1024", "--batch-size", "64", "--eval-every", "0", "--checkpoint-every", "0")


def _range(values: list[float], fmt: str = ".2f") -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} – {hi:{fmt}}"


def timing(cache: Path, ranks: int, steps: int, rounds: int) -> None:
    run = generate(cache, ranks, steps)
    mb = sum(p.stat().st_size for p in (run / "structured_logs").iterdir()) / 2**20
    rows: dict[str, list[float]] = {}
    for _ in range(rounds):  # interleaved, so each variant sees the same machine load
        for name, fn in (
            ("DuckDB read_json group-by quantiles (one run)", lambda: duckdb_query(run)),
            ("whatif (in process: read + model)", lambda: whatif(load_run(run))),
            ("`otel-train whatif --json`", lambda: cli("whatif", str(run), "--json")),
            ("DuckDB query on both runs", lambda: (duckdb_query(run), duckdb_query(run))),
            ("diff A A (in process: read both + tests)", lambda: diff_runs(load_run(run), load_run(run))),
            ("`otel-train diff A A --json`", lambda: cli("diff", str(run), str(run), "--json")),
        ):
            rows.setdefault(name, []).append(timed(fn)[0])
    one, both = rows["DuckDB read_json group-by quantiles (one run)"], rows["DuckDB query on both runs"]
    print(f"\n| what ({mb:.0f} MB, {ranks} ranks × {steps} steps, {rounds} rounds) | seconds | "
          "× DuckDB on one run | × DuckDB on the same files |")
    print("|---|---:|---:|---:|")
    for name, secs in rows.items():
        same = both if "diff" in name or "both" in name else one  # diff reads two runs
        print(f"| {name} | {_range(secs)} | {_range([s / d for s, d in zip(secs, one)])} | "
              f"{_range([s / d for s, d in zip(secs, same)])} |")


def torchrun(save_path: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
           "--save-path", str(save_path), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(save_path: Path, *args: str) -> Path:
    if torchrun(save_path, *args).wait() != 0:
        raise SystemExit(f"torchrun failed: {save_path}")
    return save_path


def whatif_accuracy(root: Path, pairs: int) -> None:
    print("\n| steps | pair | clean measured (ms) | straggler measured | whatif ideal | ideal error | "
          "measured ratio | top-rank slowdown | slowdown error | top (rank, phase) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, model, together in (("--gpu-wait-ms 50, side by side", STEADY, True),
                                   ("--gpu-wait-ms 50, one after the other", STEADY, False),
                                   ("CPU-bound (hidden 1024), one after the other", CPU_BOUND, False)):
        for i in range(pairs):
            base = (*model, "--steps", "40")
            paths = root / f"clean-{len(label)}-{i}", root / f"slow-{len(label)}-{i}"
            procs = [torchrun(paths[0], *base)]
            if not together:
                procs[0].wait()
            procs.append(torchrun(paths[1], *base, "--slow-rank", "1", "--slow-ms", "30"))
            if any(p.wait() != 0 for p in procs):
                raise SystemExit(f"torchrun failed: {paths}")
            clean, slow = whatif(load_run(paths[0])), whatif(load_run(paths[1]))
            c, s = clean["step_ms"]["measured"], slow["step_ms"]["measured"]
            top, pair = slow["by_rank"][0], slow["by_rank_phase"][0]
            print(f"| {label} | {i} | {c:.1f} | {s:.1f} | {slow['step_ms']['ideal']:.1f} | "
                  f"{100 * (slow['step_ms']['ideal'] / c - 1):+.1f} % | {s / c:.3f} | {top['slowdown']:.3f} "
                  f"(rank {top['rank']}) | {100 * (top['slowdown'] / (s / c) - 1):+.1f} % | "
                  f"({pair['rank']}, {pair['phase']}) |", flush=True)


def false_stragglers(root: Path, runs: int) -> None:
    found = []
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(runs):
            summary = summarize(run(root / f"busy-{i}", *SMALL, "--steps", "60"), warn=print)
            found += [f for f in summary["findings"] if f["kind"] == "straggler"]
            print(f"run {i}: {len(found)} straggler findings so far", file=sys.stderr, flush=True)
    finally:
        busy.kill()
        busy.wait()
    print(f"\nclean 2-rank runs beside a busy loop: {runs}; false straggler findings: {len(found)}")
    for f in found:
        print(f"  {f['message']}")


def diff_detection(root: Path, trials: int) -> None:
    # --gpu-wait-ms puts ~50 ms into forward: +10 % of it is a 5 ms sleep on rank 1.
    base = (*STEADY, "--steps", "200")
    hits = misses = false = 0
    for i in range(trials):
        paths = root / f"diff-a-{i}", root / f"diff-b-{i}", root / f"diff-s-{i}"
        # Side by side: whatever else loads the machine loads the three alike.
        procs = [torchrun(paths[0], *base), torchrun(paths[1], *base),
                 torchrun(paths[2], *base, "--slow-rank", "1", "--slow-phase", "forward", "--slow-ms", "5")]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit(f"torchrun failed: {paths}")
        a, b, slow = (load_run(p) for p in paths)
        found = [(f["kind"], f["rank"], f["phase"]) for f in diff_runs(a, slow)["findings"]]
        if ("regression", 1, "forward") in found:
            hits += 1
        else:
            misses += 1
        noise = diff_runs(a, b)["findings"]
        false += len(noise)
        print(f"trial {i}: slow -> {found}; clean vs clean -> {[f['message'] for f in noise]}", flush=True)
    print(f"\n200-step runs: rank 1's forward +10 %: found {hits}/{hits + misses}; "
          f"clean vs clean: {false} findings in {trials} comparisons")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="timing,whatif,stragglers,diff")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20, help="clean runs under contention")
    parser.add_argument("--pairs", type=int, default=3, help="clean/straggler pairs per kind")
    parser.add_argument("--trials", type=int, default=5, help="diff trials")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-bench")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    t0 = time.perf_counter()
    print(f"{os.cpu_count()} CPUs", file=sys.stderr)
    if "timing" in parts:
        timing(args.cache, args.ranks, args.steps, args.rounds)
    with tempfile.TemporaryDirectory(prefix="otel-train-answers-") as tmp:
        root = Path(tmp)
        if "whatif" in parts:
            whatif_accuracy(root, args.pairs)
        if "stragglers" in parts:
            false_stragglers(root, args.runs)
        if "diff" in parts:
            diff_detection(root, args.trials)
    print(f"\n({time.perf_counter() - t0:.0f} s in all)", file=sys.stderr)


if __name__ == "__main__":
    main()
