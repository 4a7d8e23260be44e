"""The one active runtime of this process: what ``init`` built, so ``shutdown`` can take it down in order.

``active`` is the runtime while tracing is on (None otherwise); ``lock`` guards ``init`` and
``shutdown``; ``end_signal`` names the signal a running shutdown was asked for (``process_end`` says so).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from otel_train.config import Settings
    from otel_train.exporters.jsonl.processor import JsonlSpanProcessor
    from otel_train.exporters.jsonl.writer import RotatingFileWriter
    from otel_train.exporters.otlp import BoundedBatchSpanProcessor
    from otel_train.resource import RunContext
    from otel_train.runtime.ids import StepTraceIdGenerator
    from otel_train.watchdog import Watchdog


class Runtime:
    """Everything one ``init`` built, so ``shutdown`` can take it down in order."""

    def __init__(self, settings: Settings, ctx: RunContext) -> None:
        self.settings = settings
        self.ctx = ctx
        self.pid = os.getpid()
        self.provider: TracerProvider | None = None
        self.jsonl: JsonlSpanProcessor | None = None
        self.writer: RotatingFileWriter | None = None
        self.batch_processors: list[BoundedBatchSpanProcessor] = []
        self.other_processors: list[SpanProcessor] = []
        self.record_handlers: list[Any] = []
        self.undo: list[Any] = []  # uninstallers for hooks, run in reverse at shutdown
        self.file_path: str | None = None
        self.watchdog: Watchdog | None = None
        self.comm: Any = None  # otel_train.comm.CommSession
        self.ids: StepTraceIdGenerator | None = None  # every span's ids (the comm herald chooses some ahead)


lock = threading.RLock()
active: Runtime | None = None
end_signal: str | None = None  # set while shutdown runs for a signal


def is_enabled() -> bool:
    """Whether tracing is active in this process."""
    return active is not None


def current_settings() -> Settings | None:
    """The settings of the active runtime, or None when tracing is off."""
    rt = active
    return rt.settings if rt is not None else None


def trace_file() -> str | None:
    """Path of this process's active JSONL file, or None."""
    rt = active
    return rt.file_path if rt is not None else None
