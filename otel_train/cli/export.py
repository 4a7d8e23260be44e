"""``otel-train export PATH [--output FILE] [--format chrome|perfetto|otlp-json] [--ranks 0,3-5] [--steps 100-200]
[--fr PATH] [--no-align] [--no-cache]``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._common import RUN_ID_HELP, byte_progress, cli_errors, fail, note_malformed, select_run, warn
from otel_train.cli._remember import remembered

STDOUT = "-"
"""``--output -``: the trace streamed to stdout (otel_train.analysis.outputs.STDOUT)."""

if TYPE_CHECKING:
    from otel_train.analysis.export import ExportResult

FORMATS = ("chrome", "perfetto", "otlp-json")
"""otel_train.analysis.export.FORMATS (a copy: start-up stays small; tests/test_cache.py checks it)."""


def parse_ranks(text: str) -> set[int]:
    """``0,3-5`` -> {0, 3, 4, 5}; raises ValueError with a one-line reason."""
    ranks: set[int] = set()
    for part in text.split(","):
        lo, hi = _range(part.strip(), "--ranks", "0,3-5")
        ranks.update(range(lo, hi + 1))
    return ranks


def parse_steps(text: str) -> tuple[int, int]:
    """``100-200`` -> (100, 200) inclusive; ``7`` -> (7, 7); raises ValueError with a one-line reason."""
    return _range(text.strip(), "--steps", "100-200")


def _range(part: str, option: str, example: str) -> tuple[int, int]:
    lo_s, sep, hi_s = part.partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise ValueError(f"{option} {part!r}: expected numbers and ranges like {example}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"{option} {part!r}: a range must be low-high with 0 <= low <= high, like {example}")
    return lo, hi


@app.command()
def export(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o",
        help="Output file (default <run>/analysis/structured_trace.json; .pftrace for perfetto; "
             ".otlp.json for otlp-json); - streams it to stdout. Only a regular file is ever replaced.",
    ),
    fmt: str = typer.Option(
        "chrome", "--format", "-f",
        help="chrome (JSON), perfetto (protobuf, for big runs) or otlp-json (Jaeger UI: Upload JSON).",
    ),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Only these ranks, e.g. 0,3-5."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    steps: Optional[str] = typer.Option(None, "--steps", help="Only these steps (inclusive), e.g. 100-200."),
    fr: Optional[Path] = typer.Option(
        None, "--fr",
        help="Flight Recorder dumps (a file or a directory; pickle or JSON, any name holding the rank) merged "
             "with the trace's comm ops (default <run>/flight_recorder/).",
    ),
    no_align: bool = typer.Option(
        False, "--no-align",
        help="Keep every host's raw clock (default: hosts aligned to the reference host's clock, each moved "
             "record's own time in its args as raw_ts; docs/clock.md).",
    ),
    no_cache: bool = typer.Option(False, "--no-cache",
                                  help="Neither use nor fill the run's read cache, nor reuse an earlier export."),
    profiles: bool = typer.Option(False, "--profiles",
                                  help="Merge the run's torch.profiler windows (operators, kernels) under the "
                                       "ranks' phase spans, on the trace's clock (chrome or perfetto; docs/profiling.md)."),
) -> None:
    """Write a trace for Perfetto UI / chrome://tracing: a process per rank and attempt, a track per task."""
    with cli_errors():
        select_run(run_id)
        if fmt not in FORMATS:
            fail(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
        try:
            rank_set = parse_ranks(ranks) if ranks is not None else None
            step_range = parse_steps(steps) if steps is not None else None
        except ValueError as exc:
            fail(str(exc))
        if fr is not None and not fr.exists():
            warn(f"warning: --fr {fr}: no such file or directory; exporting without Flight Recorder dumps")
        stream = output is not None and str(output) == STDOUT
        if profiles and (fmt not in ("chrome", "perfetto") or stream):
            fail("--profiles: merged into a chrome or perfetto export written to a file only; drop --format/--output -", 2)
        if stream and sys.stdout.isatty():
            fail("--output -: stdout is a terminal; pipe it (| gzip > trace.json.gz) or name a file", 2)
        if output is not None and not stream:
            from otel_train.analysis.outputs import refuse_special

            refuse_special(output, "--output")  # a device, FIFO or folder: one line, exit 2, before any work

        def compute() -> tuple[str, str | None]:
            from otel_train.analysis.export import export as export_run  # here: start-up stays small
            from otel_train.analysis.records import Reader

            with byte_progress(path, "exporting") as progress:
                reader = Reader(warn=warn, progress=progress)
                options = dict(ranks=rank_set, steps=step_range, reader=reader, fr=fr, align=not no_align,
                               cache=not no_cache)
                if profiles:
                    from otel_train.analysis.profiles_export import export_with_profiles

                    done, merged = export_with_profiles(path, fmt, output, **options)
                else:
                    done = export_run(path, fmt, sys.stdout.buffer if stream else output, **options)
                if stream:
                    sys.stdout.buffer.flush()
            note_malformed(done.malformed_lines)
            if profiles:
                return _wrote(done) + "\n" + _merged_line(merged), _clock_line(done, fmt)
            if done.processes == 0:
                warn("warning: no process matched --ranks; the trace is empty")
            return _wrote(done), _clock_line(done, fmt)

        args = {"format": fmt, "output": output and output.resolve(), "ranks": sorted(rank_set or ()) or None,
                "steps": step_range, "fr": fr and fr.resolve(), "align": not no_align, "run_id": run_id,
                "profiles": profiles}
        # A stream is never remembered (its bytes are gone once written); its lines go to stderr.
        wrote, clock_line = compute() if stream else remembered("export", [path], args, compute, enabled=not no_cache)
        for line in (wrote, clock_line):
            if line is not None:
                typer.echo(line, err=stream)


def _wrote(result: ExportResult) -> str:
    where = "stdout" if str(result.output) == STDOUT else result.output
    return (f"wrote {where}: {result.processes} processes, {result.slices} slices, "
            f"{result.instants} instants, {result.counters} counter samples"
            + (f", {result.flows} comm flows" if result.flows else "")
            + (f", {result.dump_ops} ops from Flight Recorder dumps" if result.dump_ops else ""))


def _merged_line(merged: Any) -> str:
    for problem in merged.problems:
        warn(f"warning: --profiles: {problem}; merged the others")
    windows = ", ".join(f"{w['process']} steps {w['steps'][0]}-{w['steps'][1]} ({w['reason']})"
                        for w in merged.windows)
    return f"profiles: {len(merged.windows)} windows merged, {merged.events} profiler events" + (
        f": {windows}" if windows else "")


def _clock_line(result: ExportResult, fmt: str) -> str | None:
    clock = result.clock
    if clock is None or not clock.applied or fmt not in ("chrome", "perfetto"):
        return None
    moved = ", ".join(f"{r['host']} {r['offset_ms']:+.3f} ms" for r in clock.rows()[1:])
    return f"clocks aligned to host {clock.reference}: {moved} (raw times in args raw_ts; --no-align: raw)"
