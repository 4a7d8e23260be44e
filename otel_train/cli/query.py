"""``otel-train query PATH [SQL] [--format table|csv|json|parquet] [--output FILE] [--steps A-B] [--schema]``:
one read-only SQL statement over the run's views (docs/query.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._common import EXIT_NO_TRACES, RUN_ID_HELP, cli_errors, fail, parse_window, print_text, select_run, warn
from otel_train.cli._text import clean, console

FORMATS = ("table", "csv", "json", "parquet")


@app.command()
def query(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    sql: Optional[str] = typer.Argument(None, help="One SELECT over the views (DuckDB SQL); none: list the views."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, csv, json or parquet (parquet needs --output)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the answer to this file."),
    steps: Optional[str] = typer.Option(None, "--steps", metavar="A-B",
                                        help="Only steps A..B (inclusive), read at the window's cost."),
    schema: bool = typer.Option(False, "--schema", help="List the views and their columns."),
    timeout: float = typer.Option(60.0, "--timeout", metavar="S", help="Stop a statement still running after S seconds."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither use nor fill the run's read cache."),
) -> None:
    """Ask the run in SQL: spans, comm, steps, processes, scalars, instants, findings, clock."""
    if fmt not in FORMATS:
        fail(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}", EXIT_NO_TRACES)
    if fmt == "parquet" and output is None:
        fail("--format parquet writes a file: add --output FILE.parquet", EXIT_NO_TRACES)
    if timeout <= 0:
        fail(f"--timeout {timeout:g}: expected seconds > 0", EXIT_NO_TRACES)
    window = parse_window(steps) if steps is not None else None
    try:
        import duckdb  # noqa: F401 - only asked whether it is there
    except ModuleNotFoundError:
        fail("query needs DuckDB: pip install 'otel-train[analysis]' (or duckdb)", EXIT_NO_TRACES)
    with cli_errors():
        from otel_train.analysis.query import QueryRefused, open_views, run_sql, schema_rows

        if output is not None:
            from otel_train.analysis.outputs import refuse_special

            refuse_special(output, "--output")  # a device, FIFO, folder or link: one line, exit 2, before any work
        select_run(run_id)
        con = open_views(path, steps=window, warn=warn, cache=not no_cache, run_id=run_id,
                         sql=None if schema else sql)
        try:
            if sql is None or schema:
                _print_schema(schema_rows(con))
                return
            if fmt == "parquet":
                from otel_train.analysis.query.engine import write_parquet

                n = write_parquet(con, sql, str(output), timeout_s=timeout)
                warn(f"wrote {n} rows to {output}")
                return
            result = run_sql(con, sql, timeout_s=timeout)
        except QueryRefused as exc:
            fail(f"query: {exc}", EXIT_NO_TRACES)
        finally:
            con.close()
        _emit(result, fmt, output)


def _print_schema(rows: list[tuple[str, str, str]]) -> None:
    lines: list[str] = []
    for view in dict.fromkeys(r[0] for r in rows):
        cols = ", ".join(f"{c} {t}" for v, c, t in rows if v == view)
        lines.append(f"{view}: {cols}")
    print_text("\n".join(lines) + "\n")


def _emit(result: object, fmt: str, output: Optional[Path]) -> None:
    from otel_train.analysis.query import render

    if fmt == "table":
        if output is None:
            _table(result, render.table_cells(result))  # type: ignore[arg-type]
            return
        text = render.to_csv(result)  # type: ignore[arg-type]
    else:
        text = render.to_csv(result) if fmt == "csv" else render.to_json(result)  # type: ignore[arg-type]
    if output is None:
        print_text(text)
        return
    from otel_train.analysis.outputs import replacing

    with replacing(output, "--output") as f:  # only a regular file replaced; 0644 at most
        f.write(text.encode())
    warn(f"wrote {len(result.rows)} rows to {output}")  # type: ignore[attr-defined]


def _table(result: object, cells: list[list[str]]) -> None:
    from rich.table import Table

    table = Table(show_lines=False)
    for name in result.columns:  # type: ignore[attr-defined]
        table.add_column(clean(name), overflow="fold")
    for row in cells:
        table.add_row(*clean(row))
    out = console()
    out.print(table)
    out.print(f"{len(cells)} row{'s' if len(cells) != 1 else ''}", markup=False)
