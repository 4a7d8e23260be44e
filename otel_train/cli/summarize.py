"""``otel-train summarize PATH [--json] [--fast]``: where every rank stopped, phase timings, findings."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._text import clean, console
from otel_train.cli._common import RUN_ID_HELP, cli_errors, comm_line, fmt_ms, load, print_json, select_run, warn
from otel_train.cli._remember import remembered

if TYPE_CHECKING:  # rich and the analysis are imported where they are used: start-up stays small
    from rich.console import Console


@app.command()
def summarize(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    fast: bool = typer.Option(
        False, "--fast",
        help="Read only each file's tail: where every rank stopped and the hang/crash/restart findings, "
             "in time independent of the files' size; phases from digests (approximate) or none.",
    ),
    fr: Optional[Path] = typer.Option(
        None, "--fr",
        help="Flight Recorder dumps (a file or a directory; pickle or JSON, any name holding the rank) merged "
             "with the trace's comm ops (default: the run's fr_dir, <run>/flight_recorder/).",
    ),
    no_align: bool = typer.Option(
        False, "--no-align",
        help="Compare hosts on their raw clocks: no offset is estimated or applied (docs/clock.md).",
    ),
    steps: Optional[str] = typer.Option(None, "--steps", metavar="A-B",
                                        help="Only steps A..B (inclusive), read at the window's cost."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the run's read cache."),
) -> None:
    """Which rank stopped where, per-phase timings, and findings (hang, crash, desync, error, straggler, restart)."""
    with cli_errors():
        select_run(run_id)
        if fr is not None and not fr.exists():
            warn(f"warning: --fr {fr}: no such file or directory; summarizing without Flight Recorder dumps")
        if fast:
            from otel_train.analysis.fast import summarize_fast

            summary = summarize_fast(path, warn=warn, fr=fr, align=not no_align)
        else:
            def compute() -> dict[str, Any]:
                from otel_train.analysis.profile_windows import with_profiles
                from otel_train.analysis.summary import default_fr, summarize_run, with_dumps

                run = load(path, steps=steps, cache=not no_cache)
                run.align = not no_align
                summary = summarize_run(with_dumps(run, fr if fr is not None else default_fr(path, run), warn))
                return with_profiles(summary, path)

            summary = remembered("summarize", [path], {"fr": fr and fr.resolve(), "align": not no_align, "steps": steps,
                                                       "run_id": run_id}, compute, enabled=not no_cache)
        if as_json:
            print_json(summary)
        else:
            _render(clean(summary), console())


def _ts(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def _render(summary: dict[str, Any], out: Console) -> None:
    from rich.table import Table

    from otel_train.analysis.stacks import describe_stack

    findings = summary["findings"]
    if findings:
        table = Table(title="Findings", title_justify="left", show_lines=False)
        for col in ("kind", "rank", "step", "phase", "message"):
            table.add_column(col, overflow="fold")
        for f in findings:
            table.add_row(f["kind"], _s(f["rank"]), _s(f["step"]), _s(f["phase"]), f["message"])
        out.print(table)
        for f in findings:
            if f.get("comm") and f["kind"] != "straggler":
                out.print(f"rank {_s(f['rank'])} {f['kind']}: {comm_line(f['comm'])}", markup=False)
            if f.get("stacks"):  # the stalled thread of a hang or crash culprit, from its stall records
                out.print(f"rank {f['rank']} stalled in {describe_stack(f['stacks'][0])}", markup=False)
    else:
        out.print("Findings: none")
    if summary.get("profiles"):
        from otel_train.analysis.profile_windows import line

        for window in summary["profiles"]:
            out.print(line(window), markup=False)

    procs = Table(title="Processes", title_justify="left")
    for col in ("rank", "att", "host", "pid", "step", "rel", "last event", "last (UTC)", "open spans"):
        procs.add_column(col, overflow="fold")
    for p in summary["processes"]:
        procs.add_row(
            str(p["rank"]), str(p["attempt"]), _s(p["host"]), _s(p["pid"]), _s(p["final_step"]),
            _s(p["relative_step"]), _s(p["last_event"]), _ts(p["last_ts"]), " > ".join(p["open_spans"]) or "-",
        )
    out.print(procs)
    formats: dict[str, list[str]] = {}
    for p in summary["processes"]:
        formats.setdefault(p.get("format") or "otel-train", []).append(str(p["rank"]))
    if set(formats) != {"otel-train"}:  # say whose files were read when some were not ours
        out.print("Files: " + "; ".join(f"{fmt} structured logger (ranks {', '.join(r)})" if fmt != "otel-train"
                                        else f"otel-train (ranks {', '.join(r)})" for fmt, r in formats.items()),
                  markup=False)

    if summary["unclosed"]:
        unclosed = Table(title="Unclosed spans", title_justify="left")
        for col in ("rank", "att", "span", "step", "status", "last phase", "started (UTC)"):
            unclosed.add_column(col)
        for u in summary["unclosed"]:
            unclosed.add_row(
                str(u["rank"]), str(u["attempt"]), u["name"], _s(u["step"]), u["status"],
                _s(u["last_phase"]), _ts(u["start_ts"]),
            )
        out.print(unclosed)

    if summary["phases"] is None:
        out.print("Phases: not read (--fast reads only each file's tail; the run wrote no digests)")
    else:
        _render_phases(summary["phases"], out)
    _render_clock(summary, out)
    if summary.get("goodput"):
        _render_goodput(summary["goodput"], out)
    if summary["malformed_lines"]:
        out.print(f"malformed lines skipped: {summary['malformed_lines']}")


def _render_clock(summary: dict[str, Any], out: Console) -> None:
    """Never correct silently: with more than one host, say how each host's clock was taken."""
    hosts = sorted({p["host"] for p in summary["processes"] if p["host"] is not None})
    if len(hosts) < 2:
        return
    from rich.table import Table

    rows = summary.get("clock") or []
    if not rows:
        out.print(f"Clocks: {len(hosts)} hosts, not aligned (--no-align, or no blocking collective across hosts "
                  "to align them by): times across hosts are each host's raw clock")
        return
    table = Table(title=f"Clocks: aligned to host {rows[0]['host']} (the reference; --no-align: raw clocks)",
                  title_justify="left")
    for col in ("host", "offset (ms)", "drift (ppm)", "residual (ms)", "samples"):
        table.add_column(col, justify="left" if col == "host" else "right")
    for r in rows:
        table.add_row(r["host"], f"{r['offset_ms']:+.3f}", f"{r['drift_ppm']:+.1f}", f"{r['residual_ms']:.3f}",
                      str(r["samples"]))
    out.print(table)
    missing = [h for h in hosts if h not in {r["host"] for r in rows}]
    if missing:
        out.print(f"not aligned (no collective shared with the others): {', '.join(missing)}", markup=False)


def _render_phases(rows: list[dict[str, Any]], out: Console) -> None:
    from rich.table import Table

    approx = any(ph.get("approx") for ph in rows)
    phases = Table(title="Phases (ms, approximate: from digests)" if approx else "Phases (ms)", title_justify="left")
    for col in ("phase", "count", "p50", "p95", "max", "slowest rank/att/step"):
        phases.add_column(col, justify="right" if col not in ("phase",) else "left")
    for ph in rows:
        s = ph["slowest"]
        phases.add_row(
            ph["name"], str(ph["count"]), fmt_ms(ph["p50_ms"]), fmt_ms(ph["p95_ms"]), fmt_ms(ph["max_ms"]),
            f"{s['rank']}/{s['attempt']}/{_s(s['step'])}",
        )
    out.print(phases)


def _render_goodput(g: dict[str, Any], out: Console) -> None:
    wall = g["wall_s"]
    if not wall:
        return
    from rich.table import Table

    parts = [("productive steps", g["productive_s"]), ("before the first step", g["init_s"]),
             ("checkpoint", g["checkpoint_s"]), ("eval", g["eval_s"]),
             ("steps done again after a restart (lost)", g["lost_s"]), ("restart downtime", g["restart_s"]),
             ("other (after the last step, failed or hung steps, between spans)", g.get("other_s", 0.0))]
    table = Table(title=f"Goodput: {100 * g['fraction']:.1f} % of {wall:.3g} s wall time was productive",
                  title_justify="left")
    for col in ("time went to", "s", "%"):
        table.add_column(col, justify="left" if col == "time went to" else "right")
    for label, secs in parts:
        table.add_row(label, f"{secs:.3g}", f"{100 * secs / wall:.1f}")
    out.print(table)


def _s(value: object) -> str:
    return "-" if value is None else str(value)
