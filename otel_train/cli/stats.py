"""``otel-train stats PATH [--json] [--csv FILE]``: phase statistics, step breakdown, straggler scores."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._text import clean, console
from otel_train.cli._common import (RUN_ID_HELP, cli_errors, fmt_ms, json_part, load, print_json, print_text,
                                    select_run, warn)
from otel_train.cli._remember import remembered

if TYPE_CHECKING:  # rich and the analysis are imported where they are used: start-up stays small
    from rich.console import Console

    from otel_train.analysis.spans import Run

SLOWEST_STEPS_SHOWN = 10


@app.command()
def stats(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    as_json: bool = typer.Option(False, "--json", help="Print all statistics as one JSON object."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    csv_file: Optional[Path] = typer.Option(
        None, "--csv", help="Also write the per-step, per-rank breakdown (with idle time) to this CSV file."
    ),
    steps: Optional[str] = typer.Option(None, "--steps", metavar="A-B",
                                        help="Only steps A..B (inclusive), read at the window's cost."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the run's read cache."),
) -> None:
    """Per phase x rank timings, per-step breakdown with idle time, straggler scores vs. peers."""
    with cli_errors():
        select_run(run_id)
        if csv_file is not None:
            from otel_train.analysis.outputs import refuse_special

            refuse_special(csv_file, "--csv")  # a device, FIFO or folder: one line, exit 2, before any work

        def compute() -> dict[str, Any]:
            from otel_train.analysis.stats import compute_stats

            return compute_stats(load(path, steps=steps, cache=not no_cache))

        key = {"steps": steps, "run_id": run_id}
        if as_json and csv_file is None:  # its text kept: 64,000 rank-steps are 19 MB of JSON to encode again
            text = lambda: stats_json(load(path, steps=steps, cache=not no_cache))  # noqa: E731
            print_text(remembered("stats", [path], {**key, "as": "json"}, text, enabled=not no_cache))
            return
        result = remembered("stats", [path], key, compute, enabled=not no_cache)
        if csv_file is not None:
            write_steps_csv(result["steps"], csv_file)
            warn(f"wrote {len(result['steps'])} step rows to {csv_file}")
        if as_json:
            print_json(result)
        else:
            _render(clean(result), console())


def stats_json(run: Run) -> str:
    """``json_text(compute_stats(run))``, its step rows made and encoded a process at a time: a 1 GB run's
    216,000 rows are never all dicts at once (docs/benchmarks.md, "stats at 1 GB")."""
    from otel_train.analysis.stats import phase_rows, process_step_rows, score_rows

    key = ',\n  "steps": '
    parts = ['{\n  "phases": ', json_part(phase_rows(run), 1), key]
    for rows in map(process_step_rows, run.processes):
        if rows:  # "[\n" + items + "\n  ]" of its own list: the items, then joined as one list's
            parts += ["[\n" if parts[-1] is key else ",\n", json_part(rows, 1)[2:-4]]
    parts.append("[]" if parts[-1] is key else "\n  ]")
    parts += [',\n  "straggler_scores": ', json_part(score_rows(run), 1),
              ',\n  "malformed_lines": ', json_part(run.malformed_lines, 1), "\n}\n"]
    return "".join(parts)


def write_steps_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """One row per (rank, attempt, step): step_ms, idle_ms and one ``<phase>_ms`` column per phase; written
    beside ``path`` and renamed over it (only ever a regular file: otel_train/analysis/outputs.py)."""
    phases: list[str] = []
    for row in rows:
        phases.extend(p for p in row["phases"] if p not in phases)
    import io

    from otel_train.analysis.outputs import replacing

    header = ["source", "rank", "attempt", "step", "step_ms", "idle_ms", *(f"{p}_ms" for p in phases)]
    with replacing(path, "--csv", parents=False) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        for row in rows:
            out.writerow(
                [row["source"], row["rank"], row["attempt"], row["step"], row["step_ms"], row["idle_ms"],
                 *(row["phases"].get(p, "") for p in phases)]
            )


def _render(result: dict[str, Any], out: Console) -> None:
    from rich.table import Table

    from otel_train.analysis.stats import median

    table = Table(title="Phases per rank (ms)", title_justify="left")
    for col in ("phase", "rank", "att", "count", "mean", "p50", "p95", "max"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for r in result["phases"]:
        table.add_row(
            r["name"], str(r["rank"]), str(r["attempt"]), str(r["count"]), fmt_ms(r["mean_ms"]),
            fmt_ms(r["p50_ms"]), fmt_ms(r["p95_ms"]), fmt_ms(r["max_ms"]),
        )
    out.print(table)

    steps = result["steps"]
    if steps:
        per_rank: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for row in steps:
            per_rank.setdefault((row["rank"], row["attempt"]), []).append(row)
        idle = Table(title="Steps per rank: median step and idle time (ms)", title_justify="left")
        for col in ("rank", "att", "steps", "step p50", "idle p50", "idle share"):
            idle.add_column(col, justify="right")
        for (rank, attempt), rows in sorted(per_rank.items()):
            step_ms = median([r["step_ms"] for r in rows])
            idle_ms = median([r["idle_ms"] for r in rows])
            share = f"{100 * idle_ms / step_ms:.0f}%" if step_ms else "-"
            idle.add_row(str(rank), str(attempt), str(len(rows)), fmt_ms(step_ms), fmt_ms(idle_ms), share)
        out.print(idle)
        slow = Table(title=f"Slowest {SLOWEST_STEPS_SHOWN} steps (ms)", title_justify="left")
        for col in ("step", "rank", "att", "step", "idle", "phases"):
            slow.add_column(col, justify="left" if col == "phases" else "right")
        for r in sorted(steps, key=lambda r: -r["step_ms"])[:SLOWEST_STEPS_SHOWN]:
            parts = " ".join(f"{k}={fmt_ms(v)}" for k, v in r["phases"].items())
            label = str(r["step"]) if "epoch" not in r else f'{r["step"]} (epoch {r["epoch"]}, step {r["epoch_step"]})'
            slow.add_row(label, str(r["rank"]), str(r["attempt"]), fmt_ms(r["step_ms"]), fmt_ms(r["idle_ms"]), parts)
        out.print(slow)

    scores = result["straggler_scores"]
    if scores:
        phases = list(dict.fromkeys(s["phase"] for s in scores))
        by_rank: dict[tuple[int, int], dict[str, float]] = {}
        for s in scores:
            by_rank.setdefault((s["rank"], s["attempt"]), {})[s["phase"]] = s["score"]
        grid = Table(title="Straggler score: own time / peer median, per step (median)", title_justify="left")
        grid.add_column("rank/att")
        for p in phases:
            grid.add_column(p, justify="right")
        for (rank, attempt), row in sorted(by_rank.items()):
            grid.add_row(f"{rank}/{attempt}", *(f"{row[p]:.2f}" if p in row else "-" for p in phases))
        out.print(grid)
