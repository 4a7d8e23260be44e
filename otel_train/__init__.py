"""otel-train: OpenTelemetry tracing for distributed PyTorch training.

Which rank, at which step, in which phase: training phases become OTel spans written to a crash-safe
JSONL file per rank (a record at span start and at span end) and, optionally, sent over OTLP.
The public surface is fixed in CONTRACT.md; everything else is internal.
"""

from otel_train._version import __version__
from otel_train.api import (
    add_step_tag,
    log_trace_instant,
    log_trace_scalar,
    log_trace_span,
    set_step,
    training_step,
)
from otel_train.errors import ConfigError
from otel_train.runtime import init, is_enabled, shutdown

__all__ = [
    "ConfigError",
    "__version__",
    "add_step_tag",
    "init",
    "is_enabled",
    "log_trace_instant",
    "log_trace_scalar",
    "log_trace_span",
    "set_step",
    "shutdown",
    "training_step",
]
