"""``otel-train query`` on the 320 MB benchmark run beside the expert's DuckDB query (docs/benchmarks.md,
"SQL over a run").

The run is analysis_throughput.py's (16 ranks × 4,000 steps × 5 spans, ≈ 320 MB; generated once under
the temp dir). Each round, process to process: the expert's four-column DuckDB query over the raw
JSONL in its own Python process; ``otel-train query RUN SQL`` with the same per-phase count, p50, p95
and max over the ``spans`` view, first (read cache cleared) and again (the views served from the
cache); and the start-up reference, the same command's second run on a 2-rank × 20-step run. Targets
(issue 45): first answer ≤ 1.5× the DuckDB query; a repeat ≤ 0.1 s over the start-up reference.

    .venv/bin/python benchmarks/query_throughput.py [--repeat N] [--ranks N --steps M]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from analysis_throughput import CLI, DUCK_PROCESS, bench_env, busy_loop, drop_cache, duckdb_sql, generate, process

SQL = ("SELECT name, count(*), quantile_cont(dur_ms, 0.5), quantile_cont(dur_ms, 0.95), max(dur_ms) "
       "FROM spans GROUP BY name ORDER BY name")


def one_round(run: Path, small: Path, env: dict[str, str]) -> dict[str, float]:
    """Wall seconds of each row in one round, and CPU seconds (``<row>_cpu``: all threads and workers)."""
    out: dict[str, float] = {}

    def row(key: str, argv: list[str]) -> None:
        out[key], out[f"{key}_cpu"], _ = process(argv, env)

    row("duckdb", [sys.executable, "-c", DUCK_PROCESS, duckdb_sql(run)])
    drop_cache(run)
    row("first", [str(CLI), "query", str(run), SQL, "--format", "csv"])
    row("repeat", [str(CLI), "query", str(run), SQL, "--format", "csv"])
    process([str(CLI), "query", str(small), SQL, "--format", "csv"], env)  # fills the small run's cache
    row("startup", [str(CLI), "query", str(small), SQL, "--format", "csv"])
    return out


def table(rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    """Median (range) of each row per condition, the first answer's ratio to DuckDB, the repeat's excess."""
    lines = ["| what | " + " | ".join(f"{c}: s, median (range)" for c in rounds) + " | target |",
             "|---|" + "---:|" * len(rounds) + "---|"]

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f} – {max(values):.2f})"

    labels = {"duckdb": "DuckDB query over the raw JSONL, own process",
              "first": "`otel-train query` first answer (cache cleared)",
              "repeat": "`otel-train query` repeat (views from the cache)",
              "startup": "start-up: the same command's repeat on 2 ranks × 20 steps"}
    for key, label in labels.items():
        lines.append(f"| {label} | " + " | ".join(cell([r[key] for r in rs]) for rs in rounds.values()) + " | |")
        lines.append(f"| … its CPU seconds | " + " | ".join(cell([r[f'{key}_cpu'] for r in rs]) for rs in rounds.values())
                     + " | |")
    ratio = {c: statistics.median(r["first"] / r["duckdb"] for r in rs) for c, rs in rounds.items()}
    extra = {c: statistics.median(r["repeat"] - r["startup"] for r in rs) for c, rs in rounds.items()}
    worst_ratio, worst_extra = max(ratio.values()), max(extra.values())
    lines.append("| first answer ÷ DuckDB (median of the rounds' ratios) | " + " | ".join(
        f"{v:.2f}×" for v in ratio.values()) + f" | ≤ 1.5×: **{'met' if worst_ratio <= 1.5 else 'missed'}** |")
    cpu = {c: statistics.median(r["first_cpu"] / r["duckdb_cpu"] for r in rs) for c, rs in rounds.items()}
    lines.append("| first answer ÷ DuckDB in CPU seconds | " + " | ".join(f"{v:.2f}×" for v in cpu.values()) + " | |")
    lines.append("| repeat − start-up | " + " | ".join(f"{v:+.2f} s" for v in extra.values())
                 + f" | ≤ 0.1 s: **{'met' if worst_extra <= 0.1 else 'missed'}** |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="also run the rounds beside a busy loop on one core")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-bench")
    args = parser.parse_args()
    run, small = generate(args.cache, args.ranks, args.steps), generate(args.cache, 2, 20)
    env = bench_env(args.cache)
    process([sys.executable, "-c", DUCK_PROCESS, duckdb_sql(run)], env)  # the run in the page cache
    one_round(run, small, env)  # bytecode written, imports warm
    rounds = {"quiet": [one_round(run, small, env) for _ in range(args.repeat)]}
    if args.busy:
        with busy_loop():
            rounds["busy loop"] = [one_round(run, small, env) for _ in range(args.repeat)]
    mb = sum(p.stat().st_size for p in (run / "structured_logs").iterdir()) / 2**20
    print(f"run: {args.ranks} ranks × {args.steps} steps, {mb:.0f} MB; {args.repeat} rounds\n")
    print("\n".join(table(rounds)))


if __name__ == "__main__":
    main()
