"""The ``otel-train`` command line: parses arguments, calls ``otel_train.analysis``, prints.

Each command lives in its own module (``otel_train/cli/<command>.py``) as one function decorated
with ``@app.command()`` where ``app`` comes from ``otel_train.cli._app``; importing the module
registers it.
"""

from __future__ import annotations

import importlib
import os

from otel_train.cli._app import app

COMMANDS = ("summarize", "export", "stats", "push", "watch", "whatif", "diff", "query", "mcp")

for _name in COMMANDS:
    importlib.import_module(f"{__name__}.{_name}")


def main() -> None:
    """Console-script entry point."""
    # The analysis is numpy vector code, one thread: OpenBLAS's pool (one thread a CPU, started when numpy
    # is imported) only costs start-up, most when another job holds a core (docs/benchmarks.md, "Start-up").
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    app()


__all__ = ["app", "main"]
