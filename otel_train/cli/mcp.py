"""``otel-train mcp [ROOT ...]``: the Model Context Protocol server on stdio (docs/mcp.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._common import EXIT_NO_TRACES, fail


@app.command()
def mcp(
    roots: Optional[list[Path]] = typer.Argument(
        None, help="Run directories or folders holding them (default: the current directory); no tool reads outside."),
) -> None:
    """Serve the runs to an MCP client (an agent) on stdio: list_runs, run_overview, findings, live_status,
    whatif, diff, query, span_details, collective, export, explain."""
    given = roots or [Path.cwd()]
    for root in given:
        if not root.is_dir():
            fail(f"mcp: {root}: not a directory; give run directories or folders holding them", EXIT_NO_TRACES)
    try:
        from otel_train.analysis.mcp.server import serve
    except ModuleNotFoundError as exc:
        fail(f"mcp: the mcp SDK is not installed ({exc.name}): pip install 'otel-train[mcp]'", EXIT_NO_TRACES)
    serve(given)
