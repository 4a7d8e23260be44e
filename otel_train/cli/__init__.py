"""The ``otel-train`` command line: parses arguments, calls ``otel_train.analysis``, prints."""

from __future__ import annotations

from typing import Optional

import typer

from otel_train._version import __version__

app = typer.Typer(
    name="otel-train",
    help="Summarize, export and inspect otel-train trace files.",
    no_args_is_help=True,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"otel-train {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """otel-train: which rank, at which step, in which phase."""


def main() -> None:
    """Console-script entry point."""
    app()
