"""``otel-train diff PATH_A PATH_B [--json] [--baseline PATH ...]``: run B against run A, per phase and per rank x
phase (and, with more runs of A, against their spread)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._text import clean, console
from otel_train.cli._common import RUN_ID_HELP, cli_errors, fail, fmt_ms, load, print_json, select_run
from otel_train.cli._remember import remembered

if TYPE_CHECKING:  # rich and the analysis are imported where they are used: start-up stays small
    from rich.console import Console

SHOWN = 20
DEFAULT_MAX_P, DEFAULT_MIN_PCT, DEFAULT_MIN_MS = 0.01, 5.0, 0.5
MIN_BASELINES = 2
"""otel_train.analysis.diff.MIN_RUNS - 1 (checked by tests/test_cli_imports.py, like the thresholds)."""
"""otel_train.analysis.diff.Thresholds' defaults, without importing the analysis (numpy) at start-up
(tests/test_cli_imports.py checks that the two agree)."""


@app.command()
def diff(
    path_a: Path = typer.Argument(..., help="Run A (the baseline): run directory or its structured_logs/."),
    path_b: Path = typer.Argument(..., help="Run B (compared against A)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as one JSON object."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    max_p: float = typer.Option(DEFAULT_MAX_P, "--max-p", min=0.0, max=1.0,
                                help="A change is significant below this Mann-Whitney p-value."),
    min_pct: float = typer.Option(DEFAULT_MIN_PCT, "--min-pct", min=0.0, help="... and at least this % of A's median"),
    min_ms: float = typer.Option(DEFAULT_MIN_MS, "--min-ms", min=0.0, help="... and at least this many ms."),
    steps: Optional[str] = typer.Option(None, "--steps", metavar="A-B",
                                        help="Only steps A..B (inclusive), read at the window's cost."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the run's read cache."),
    baseline: Optional[List[Path]] = typer.Option(
        None, "--baseline", metavar="PATH",
        help=f"Another run of A's kind (repeat; at least {MIN_BASELINES}): a change all ranks share must also lie "
             "outside the spread of A's runs (Student's t at --max-p)."),
) -> None:
    """Did B get slower? p50/p95 per phase and per rank x phase in both runs, the change and its
    significance; regressions and improvements that are significant and big enough."""
    more = list(baseline or [])
    with cli_errors():
        select_run(run_id)
        if 0 < len(more) < MIN_BASELINES:
            fail(f"--baseline given {len(more)} time(s): the spread of A's runs needs at least {MIN_BASELINES} "
                 f"more runs of A (repeat --baseline), or none")

        def compute() -> dict[str, Any]:
            from otel_train.analysis.diff import Thresholds, diff_runs

            a = load(path_a, "reading A", steps=steps, cache=not no_cache)
            b = load(path_b, "reading B", steps=steps, cache=not no_cache)
            extra = [load(p, f"reading baseline {i + 1}", steps=steps, cache=not no_cache) for i, p in enumerate(more)]
            return diff_runs(a, b, Thresholds(max_p, min_pct, min_ms), baselines=extra)

        result = remembered("diff", [path_a, path_b, *more], {"max_p": max_p, "min_pct": min_pct, "min_ms": min_ms,
                                                             "steps": steps, "run_id": run_id}, compute,
                            enabled=not no_cache)
        if as_json:
            print_json(result)
        else:
            _render(clean(result), console())


def _verdict(row: dict[str, Any]) -> str:
    """A row's verdict; a phase that contains others (``step``) has none of its own: its change is theirs."""
    if row.get("container"):
        return "(its phases)" if row["regression"] or row["improvement"] or row.get("undecided") else ""
    return ("regression" if row["regression"] else "improvement" if row["improvement"] else
            "undecided" if row.get("undecided") else "")


def _rows(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(phase, rank, row) for every phase (all ranks) and the rank x phase comparisons that are
    significant, regressions first, then improvements, each by the size of the change."""
    collective = {p["name"] for p in result["phases"] if p["collective"]}
    max_p = result["thresholds"]["max_p"]
    out = [(p["name"], "all", p) for p in result["phases"]]
    out += [(r["phase"], str(r["rank"]), r) for r in result["ranks"] if r["p_value"] < max_p]
    out = [(f"{name} (own time)" if name in collective else name, rank, row) for name, rank, row in out]

    def effect(item: tuple[str, str, dict[str, Any]]) -> tuple[int, float]:
        row = item[2]
        group = 2 if row.get("container") else 0 if row["regression"] else 1 if row["improvement"] else 2
        return group, -abs(row["delta_ms"]) if row["delta_ms"] == row["delta_ms"] else 0.0

    return sorted(out, key=effect)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or value != value else format(value, fmt)


def _render(result: dict[str, Any], out: Console) -> None:
    from rich.table import Table
    from rich.text import Text

    steps, th = result["steps"], result["thresholds"]
    aligned = f"on the {steps['shared']} steps both ran" if steps["shared"] else "on all steps (no step numbers shared)"
    out.print(f"B against A {aligned}; a finding needs p < {th['max_p']:g}, >= {th['min_pct']:g} % and "
              f">= {th['min_ms']:g} ms (Mann-Whitney U; a collective phase is judged on its own time, "
              f"without the waiting)", highlight=False)
    if result.get("a_runs", 1) > 1:
        out.print(f"A change of all ranks must also lie outside the spread of the {result['a_runs']} runs of A "
                  f"(Student's t at p < {th['max_p']:g})", highlight=False)
    for f in result["findings"]:
        out.print(Text.assemble((f["kind"], "bold"), f": {f['message']}"))
    undecided = result.get("undecided") or []
    for u in undecided:
        out.print(Text.assemble(("undecided", "bold"), f": {u['message']}"))
    if not result["findings"]:
        out.print("No regression or improvement above the thresholds" +
                  (f"; {len(undecided)} change(s) big enough to matter could not be judged (above)." if undecided
                   else "."))
    rows = _rows(result)
    table = Table(title="Medians (ms) per phase, and per rank where the change is significant; regressions "
                        "first, by the size of the change", title_justify="left")
    for col in ("phase", "rank", "A", "B", "Δ ms", "Δ %", "p", "verdict"):
        table.add_column(col, justify="left" if col in ("phase", "verdict") else "right")
    for name, rank, row in rows[:SHOWN]:
        a50, b50 = row["judged_ms"]
        pct = None if not a50 or a50 != a50 or b50 is None else 100.0 * (b50 - a50) / a50
        table.add_row(name, rank, fmt_ms(a50), fmt_ms(b50), _num(row["delta_ms"], "+.3g"), _num(pct, "+.1f"),
                      _num(row["p_value"], ".1g"), _verdict(row))
    out.print(table)
    if len(rows) > SHOWN:
        out.print(f"{len(rows) - SHOWN} more rows; --json shows every rank x phase")
