"""OTLP export through the OTel SDK's own exporters, batched off the training thread, with bounded shutdown."""

from __future__ import annotations

from otel_train.exporters.otlp.processor import BoundedBatchSpanProcessor, shutdown_processors
from otel_train.exporters.otlp.wiring import build_span_processors, otlp_protocol, sampler_from_env

__all__ = ["BoundedBatchSpanProcessor", "build_span_processors", "otlp_protocol", "sampler_from_env", "shutdown_processors"]
