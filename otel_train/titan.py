"""torchtitan and pimm: their structured logger's events as otel-train spans, instants and scalars.

One variable, no change to the training code (docs/integrations-frameworks.md, "torchtitan and pimm")::

    TITAN_STRUCT_LOGGER_HANDLERS=otel_train.titan.register_handler            # torchtitan
    PIMM_STRUCT_LOGGER_HANDLERS=otel_train.titan.register_handler             # pimm

(list their JSONL factory too, comma-separated, to keep their own files). The framework calls
:func:`register_handler` from ``init_structured_logger``, once per process, with its logger, rank,
source and output folder. It starts otel-train (``otel_train.init``) when nothing has yet, writing
under ``OTEL_TRAIN_SAVE_PATH`` or else that folder, and attaches :class:`OtelTrainHandler`: each
``<name>_start`` opens ``log_trace_span(name)`` (on the calling thread, so it is the current span
and a collective inside it is its child), the matching ``<name>_end`` closes it (LIFO per thread and
task name, as their analysis pairs them), ``<name>_error`` makes that end an error with the
exception being raised, ``metric_value`` is ``log_trace_scalar``, any other instant is
``log_trace_instant``, and a record's ``step`` is ``set_step``.

torchtitan calls the factory in ``train.main`` before it builds the trainer, so before
``init_process_group`` and before the model is wrapped by FSDP: the communication recorder patches
``torch.distributed`` before the first collective, and the Flight Recorder buffer is on.

This module imports neither torch nor the framework; ``otel_train`` is imported when the factory runs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

__all__ = ["OtelTrainHandler", "register_handler"]

_START, _END, _ERROR = "_start", "_end", "_error"
EVENT = "event"
METRIC = "metric_value"


class _RecordedError(Exception):
    """Their error record's message, when the exception itself is not at hand."""


class OtelTrainHandler(logging.Handler):
    """A ``logging.Handler`` for their structured logger that makes each event an otel-train call."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        import otel_train

        self._ot = otel_train
        self._step: int | None = None
        self._open: dict[tuple[int, str | None], list[tuple[str, Any]]] = {}
        self._errors: dict[tuple[int, str | None, str], BaseException] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._emit(record)
        except Exception:  # noqa: BLE001 - never into their training loop (logging's own rule)
            self.handleError(record)

    def _emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, "log_type_name", None)
        if not isinstance(kind, str):
            return
        step = getattr(record, "step", None)
        if type(step) is int and step != self._step and step >= 0:
            self._step = step
            self._ot.set_step(step)
        if getattr(record, "log_type", EVENT) != EVENT:
            self._instant(record, kind)
            return
        key = (threading.get_ident(), getattr(record, "task_name", None))
        if kind.endswith(_START):
            span = self._ot.log_trace_span(kind[: -len(_START)])
            span.__enter__()
            self._open.setdefault(key, []).append((kind[: -len(_START)], span))
        elif kind.endswith(_END):
            self._end(key, kind[: -len(_END)])
        elif kind.endswith(_ERROR):
            exc = sys.exc_info()[1]  # their __exit__ logs it while the exception is in flight
            if exc is None:
                exc = _RecordedError(record.getMessage())
            self._errors[(*key, kind[: -len(_ERROR)])] = exc
        else:
            self._instant(record, kind)

    def _end(self, key: tuple[int, str | None], name: str) -> None:
        stack = self._open.get(key)
        if not stack:
            return
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == name:
                break
        else:
            return
        while len(stack) > i:  # spans above it never ended (their LIFO rule): they end with it
            _, span = stack.pop()
            exc = self._errors.pop((*key, name), None) if len(stack) == i else None
            if exc is None:
                span.__exit__(None, None, None)
            else:
                span.__exit__(type(exc), exc, exc.__traceback__)
        if not stack:
            del self._open[key]

    def _instant(self, record: logging.LogRecord, kind: str) -> None:
        if kind == METRIC:
            name, value = getattr(record, "event_name", None), getattr(record, "value", None)
            if isinstance(name, str) and isinstance(value, (int, float)):
                self._ot.log_trace_scalar({name: value})
            return
        self._ot.log_trace_instant(kind)


def register_handler(*, structured_logger: logging.Logger, rank: int, source: str, output_dir: str,
                     **_: Any) -> OtelTrainHandler:
    """The handler factory named in ``TITAN_STRUCT_LOGGER_HANDLERS`` / ``PIMM_STRUCT_LOGGER_HANDLERS``.

    Starts otel-train unless the process already did (enabled unless ``OTEL_TRAIN_ENABLED`` is set;
    ``OTEL_TRAIN_SAVE_PATH``, else ``output_dir``; every other setting from its own variables,
    docs/settings.md) and attaches the handler to
    ``structured_logger``. ``rank`` and ``source`` are theirs; otel-train takes the rank from the
    launcher's environment, as it always does."""
    import otel_train

    if not otel_train.is_enabled():
        # Naming the factory asks for tracing: enabled unless OTEL_TRAIN_ENABLED says otherwise.
        switch = {} if "OTEL_TRAIN_ENABLED" in os.environ else {"enabled": True}
        otel_train.init(save_path=None if os.environ.get("OTEL_TRAIN_SAVE_PATH") else output_dir, **switch)
    handler = OtelTrainHandler()
    structured_logger.addHandler(handler)
    return handler
