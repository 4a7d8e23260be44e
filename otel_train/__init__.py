"""otel-train: OpenTelemetry tracing for distributed PyTorch training.

Public API (see CONTRACT.md): ``init``, ``shutdown``, ``is_enabled``, ``log_trace_span``,
``log_trace_instant``, ``log_trace_scalar``, ``add_step_tag``, ``set_step``, ``training_step``,
``ConfigError``.
"""

from otel_train._version import __version__
from otel_train.errors import ConfigError

__all__ = ["ConfigError", "__version__"]
