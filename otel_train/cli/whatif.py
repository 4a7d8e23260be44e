"""``otel-train whatif PATH [--json] [--method peers|typical] [--plot FILE]``: what each rank's, phase's and
mesh index's slowness costs per step."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._text import clean, console
from otel_train.cli._common import RUN_ID_HELP, cli_errors, fail, fmt_ms, load, print_json, select_run, warn
from otel_train.cli._remember import remembered

if TYPE_CHECKING:  # rich and the analysis are imported where they are used: start-up stays small
    from rich.console import Console

SYNC_PHASES = ("backward",)
"""otel_train.analysis.whatif.SYNC_PHASES, the --sync default, without importing the analysis at start-up
(tests/test_cli_imports.py checks that the two agree)."""

METHODS = ("peers", "typical")
"""otel_train.analysis.whatif.METHODS (default: typical with an otel_train.mesh, else peers)."""
SHOWN = 10
MIN_PCT = 1.0
"""(rank, phase) pairs that cost less than this % of a step are left out of the text (not of --json)."""


@app.command()
def whatif(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the answer as one JSON object."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    sync: str = typer.Option(",".join(SYNC_PHASES), "--sync", metavar="PHASE,…",
                             help="Phases that end with a collective (data parallel: backward's all-reduce)."),
    no_align: bool = typer.Option(False, "--no-align",
                                  help="Compare hosts on their raw clocks, not the estimate (docs/clock.md)."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE",
                                        help="Also draw the slowdown heatmap as PNG or SVG (by suffix): data-parallel "
                                             "rank x pipeline stage with a mesh, else rank x phase."),
    method: Optional[str] = typer.Option(None, "--method", metavar="peers|typical",
                                         help="peers: each rank made like its peers at the same step; typical "
                                              "(OSDI '25): every op at its typical duration. Default: typical "
                                              "with an otel_train.mesh, else peers."),
    steps: Optional[str] = typer.Option(None, "--steps", metavar="A-B",
                                        help="Only steps A..B (inclusive), read at the window's cost."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the run's read cache."),
) -> None:
    """How much faster each step would be with each rank, and each phase, made typical (replayed
    through the synchronisation the spans show: every rank waits for the slowest at each collective)."""
    with cli_errors():
        if method is not None and method not in METHODS:
            fail(f"--method {method!r}: use peers or typical", 2)
        select_run(run_id)
        if plot is not None:
            from otel_train.analysis.outputs import refuse_special

            refuse_special(plot, "--plot")  # a device, FIFO or folder: one line, exit 2, before any work
        phases = [s.strip() for s in sync.split(",") if s.strip()]

        def compute() -> dict[str, Any]:
            from otel_train.analysis.whatif import whatif as whatif_run

            run = load(path, steps=steps, cache=not no_cache)
            run.align = not no_align
            return whatif_run(run, sync=phases, method=method)

        run = None  # the clock line is read from the result
        result = remembered("whatif", [path], {"sync": phases, "align": not no_align, "method": method, "steps": steps,
                                               "run_id": run_id}, compute, enabled=not no_cache)
        if plot is not None:
            _plot(result, plot)
        if as_json:
            print_json(result)
        else:
            _render(clean(result), console())
            _clock_line(run, clean(result), console())


def _plot(result: dict[str, Any], path: Path) -> None:
    from otel_train.analysis.outputs import OutputError
    from otel_train.analysis.plot import write_heatmap

    try:
        warn(f"heatmap: {write_heatmap(result, path)}")
    except ValueError as exc:
        fail(str(exc), 2 if isinstance(exc, OutputError) else 1)
    except ImportError:
        fail(f"--plot {path}: matplotlib is not installed; pip install 'otel-train[analysis]'")


def _clock_line(run: Any, result: dict[str, Any], out: Console) -> None:
    """Never correct silently: with more than one host, say which clocks the replay compared."""
    note = result.get("clock")
    if not note:
        return
    if note["aligned"]:
        moved = ", ".join(f"{r['host']} {r['offset_ms']:+.3f} ms" for r in note["hosts"][1:])
        out.print(f"clocks: hosts aligned to host {note['reference']} from the collectives ({moved}; --no-align: "
                  "each host shifted to the others' median instead)", markup=False)
    else:
        out.print("clocks: hosts not aligned by an estimate (--no-align, or no collective across hosts): each host "
                  "shifted so its ranks leave the collectives with the others at the median", markup=False)


def _slowdown_text(slowdown: float | None, digits: int) -> str:
    """A slowdown as ``1.23x``; ``-`` where the model gives none (an ideal step of zero or less)."""
    return "-" if slowdown is None else f"{slowdown:.{digits}f}x"


def _pct(row: dict[str, Any]) -> str:
    return f"{row['cost_pct']:.1f} %"


def _unsynced_lines(result: dict[str, Any], out: Console) -> None:
    """Groups left out of the replay: their collectives do not make every rank wait for the last."""
    for u in result.get("unsynchronized") or []:
        ranks = u["ranks"]
        who = f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else f"ranks {ranks}"
        out.print(f"What-if left out {who}: {', '.join(u['sync'])} does not synchronise them (in "
                  f"{100.0 * u['share']:.0f} % of its ops a rank left a median {u['early_ms']:.1f} ms before the last "
                  "one arrived); --sync names the phase that ends with a collective, or the hosts' clocks are off "
                  "(docs/clock.md)", markup=False)


def _render(result: dict[str, Any], out: Console) -> None:
    from rich.table import Table

    _unsynced_lines(result, out)
    if result.get("method") == "typical":
        _render_typical(result, out)
        return
    if not result["steps"]:
        out.print(f"What-if: no steps to replay: it needs two or more ranks that share steps with the collective "
                  f"phase {', '.join(result['sync'])} (--sync names others).")
        return
    ms = result["step_ms"]
    out.print(
        f"What-if over {result['steps']} steps (collective: {', '.join(result['sync'])}): mean step "
        f"{fmt_ms(ms['actual'])} ms (measured {fmt_ms(ms['measured'])} ms); with every rank and phase "
        f"typical {fmt_ms(ms['ideal'])} ms, a slowdown of {_slowdown_text(result['slowdown'], 2)}"
    )
    pairs = [r for i, r in enumerate(result["by_rank_phase"]) if r["cost_ms"] > 0 and (i == 0 or r["cost_pct"] >= MIN_PCT)]
    if pairs:
        table = Table(title="What each rank's phase costs every step", title_justify="left")
        for col in ("", "costs", "ms/step", "step if typical (ms)"):
            table.add_column(col, justify="left" if not col else "right")
        for r in pairs:
            table.add_row(f"rank {r['rank']}'s {r['phase']}", _pct(r), fmt_ms(r["cost_ms"]),
                          fmt_ms(ms["actual"] - r["cost_ms"]))
        out.print(table)
    for key, label in (("by_rank", "rank"), ("by_phase", "phase")):
        table = Table(title=f"By {label}: {label} made typical", title_justify="left")
        for col in (label, "slowdown", "costs", "ms/step"):
            table.add_column(col, justify="left" if col == label else "right")
        for r in result[key][:SHOWN]:
            name = str(r[label]) + (" (collective)" if r.get("collective") else "")
            table.add_row(name, _slowdown_text(r["slowdown"], 3), _pct(r), fmt_ms(r["cost_ms"]))
        out.print(table)
    out.print("collective: only its own time is made typical; the waiting in it is charged to the rank and "
              "phase that caused it")


def _p2p(phase: str) -> bool:
    """A point-to-point op's span (``comm.send``, ``comm.recv``): a comm op, not a collective."""
    from otel_train import schema

    return schema.comm_op_of(phase) in schema.P2P_OPS


def _times(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


def _share(x: Any) -> str:
    return "n/a" if x is None else f"{100.0 * x:.0f} %"


def _render_typical(result: dict[str, Any], out: Console) -> None:
    """The 3-D table: S, each mesh dim's indices, the shares, the top ranks and phases."""
    from rich.table import Table

    if not result["steps"]:
        out.print("What-if (typical): no steps to replay: it needs two steps or more with ops on some rank.")
        return
    ms, shares = result["step_ms"], result["shares"]
    out.print(f"What-if (typical: every op at its typical duration, after OSDI '25) over {result['steps']} steps: "
              f"mean step {fmt_ms(ms['actual'])} ms (measured {fmt_ms(ms['measured'])} ms), ideal "
              f"{fmt_ms(ms['ideal'])} ms: slowdown S = {_times(result['slowdown'])}")
    _typical_notes(result, out)
    workers = ", ".join(str(r) for r in result.get("workers", []))
    many = len(result.get("workers", [])) > 1
    out.print(f"Share of the slowdown explained by the last stage: {_share(shares['last_stage'])}; by the slowest "
              f"worker{'s' if many else ''} (rank{'s' if many else ''} {workers or 'n/a'}: the slowest 3 %, at least "
              f"one): {_share(shares['worker'])}")
    table = Table()  # titles printed as lines of their own: a narrow table would fold them
    for col in ("dim", "index", "slowdown", "ms/step over ideal"):
        table.add_column(col, justify="left" if col == "dim" else "right")
    for dim, rows in result["by_dim"].items():
        for r in sorted(rows, key=lambda r: -r["slowdown"])[:SHOWN]:
            table.add_row(str(dim), str(r["index"]), _times(r["slowdown"]), fmt_ms(r["cost_ms"]))
    if result["by_dim"]:
        out.print("By mesh index: only its ranks as measured, all else typical")
        out.print(table)
    for key, label in (("by_rank", "rank"), ("by_phase", "phase")):
        table = Table()
        for col in (label, "slowdown", "ms/step over ideal"):
            table.add_column(col, justify="left" if col == label else "right")
        for r in result[key][:SHOWN]:
            name = str(r[label]) + (" (collective)" if r.get("collective") and not _p2p(str(r[label])) else "")
            table.add_row(name, _times(r["slowdown"]), fmt_ms(r["cost_ms"]))
        out.print(f"Top {label}s: only that {label} as measured, all else typical")
        out.print(table)


def _typical_notes(result: dict[str, Any], out: Console) -> None:
    """What the replay did with untraced waits and device-stream overlaps, and the ops it could not use."""
    waits, snapped, left = result.get("waits") or 0, result.get("snapped") or 0, result.get("left_out")
    if waits or snapped:
        out.print(f"Untraced waits on another rank's op: {waits} (zero in the ideal, charged to the rank waited for); "
                  f"comm ops snapped to a neighbour they overlapped by at most 0.2 ms: {snapped}", markup=False)
    if left:
        out.print(f"Left out of the replay: {left['ops']} comm ops ({left['why']})", markup=False)
