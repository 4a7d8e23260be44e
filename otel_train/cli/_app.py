"""The Typer application object; command modules import ``app`` from here and register on it."""

from __future__ import annotations

import typer

from otel_train._version import __version__

app = typer.Typer(
    name="otel-train",
    help="Summarize, export and inspect otel-train trace files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help and usage errors in click's plain text: typer's rich formatting imports rich and markdown-it
    # (about 100 ms, two thirds of --help's start-up) and reads help text as rich markup
    # (docs/benchmarks.md, "Start-up").
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"otel-train {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """otel-train: which rank, at which step, in which phase."""
