"""otel-train: OpenTelemetry tracing for distributed PyTorch training.

Which rank, at which step, in which phase: training phases become OTel spans written to a crash-safe
JSONL file per rank (a record at span start and at span end) and, optionally, sent over OTLP.
The public surface is the one README.md and docs/ describe; everything else is internal.

The public names are loaded on first use, so ``otel_train.analysis`` and the CLI do not pay for
importing the tracing runtime and the OTel SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from otel_train._version import __version__
from otel_train.errors import ConfigError

if TYPE_CHECKING:
    from otel_train.api import (
        add_step_tag,
        log_trace_instant,
        log_trace_scalar,
        log_trace_span,
        set_step,
        training_step,
    )
    from otel_train.comm.mesh import set_mesh
    from otel_train.runtime import init, is_enabled, shutdown

_HOME = {
    "add_step_tag": "otel_train.api",
    "log_trace_instant": "otel_train.api",
    "log_trace_scalar": "otel_train.api",
    "log_trace_span": "otel_train.api",
    "set_step": "otel_train.api",
    "training_step": "otel_train.api",
    "set_mesh": "otel_train.comm.mesh",
    "init": "otel_train.runtime",
    "is_enabled": "otel_train.runtime",
    "shutdown": "otel_train.runtime",
}

__all__ = ["ConfigError", "__version__", *_HOME]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'otel_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
