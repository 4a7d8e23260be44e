"""The ``otel-train`` command line: parses arguments, calls ``otel_train.analysis``, prints.

Each command lives in its own module (``otel_train/cli/<command>.py``) as one function decorated
with ``@app.command()`` where ``app`` comes from ``otel_train.cli._app``; importing the module
registers it.
"""

from __future__ import annotations

import importlib

from otel_train.cli._app import app

COMMANDS = ("summarize", "export", "stats", "push", "watch", "whatif", "diff")

for _name in COMMANDS:
    importlib.import_module(f"{__name__}.{_name}")


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
