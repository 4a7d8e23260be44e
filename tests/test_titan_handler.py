"""``otel_train.titan:register_handler``: torchtitan's (and pimm's) structured-logger events as
otel-train spans, instants and scalars (CONTRACT.md, "Other structured loggers' files").

The records are made as their ``log_trace_span`` / ``log_trace_instant`` / ``log_trace_scalar`` make
them (``logger.info(msg, extra=event_extra(...))``, the ``_error`` record logged from ``__exit__``
while the exception is in flight); with torchtitan installed, its own logger drives the factory,
beside its JSONL factory, in a process that then makes a gloo group and an all_reduce.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.analysis.spans import read_process
from otel_train.analysis.reading.discovery import find_process_files
from otel_train.analysis.reading.whole import Reader
from otel_train.titan import register_handler
from tests import titan_env


def _extra(kind: str, *, step: int | None = None, value: float | None = None, event_name: str | None = None,
           log_type: str = "event", task: str | None = None) -> dict:
    return {"log_type": log_type, "log_type_name": kind, "event_name": event_name, "step": step,
            "relative_step": None, "value": value, "task_name": task}


class _Span:
    """Their log_trace_span, as far as records go."""

    def __init__(self, logger: logging.Logger, name: str, step: int) -> None:
        self.logger, self.name, self.step = logger, name, step

    def __enter__(self) -> None:
        self.logger.info("", extra=_extra(f"{self.name}_start", step=self.step))

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.logger.info(f"[step {self.step}] {self.name}_error: {exc_type.__name__}: {exc}",
                             extra=_extra(f"{self.name}_error", step=self.step))
        self.logger.info("", extra=_extra(f"{self.name}_end", step=self.step, value=1.0))


def _logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def _states(path: Path) -> list:
    return [read_process(pf, 0, Reader(warn=lambda _: None), keep=True)
            for pf in find_process_files(path, warn=lambda _: None)]


def test_their_events_become_our_spans_scalars_and_instants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_SAVE_PATH", str(tmp_path / "ours"))
    logger = _logger("test.titan.structured")
    handler = register_handler(structured_logger=logger, rank=0, source="training", output_dir=str(tmp_path / "dump"))
    try:
        assert ot.is_enabled()
        for step in (1, 2):
            with _Span(logger, "step", step):
                with _Span(logger, "fetching_batch", step):
                    pass
                logger.info("", extra=_extra("metric_value", step=step, value=2.5, event_name="loss", log_type="instant"))
                with pytest.raises(ValueError), _Span(logger, "fwd_bwd", step):
                    if step == 2:
                        raise ValueError("bad batch")
                    logger.info("", extra=_extra("checkpoint_saved", step=step, log_type="instant"))
                    raise ValueError("first")
    finally:
        logger.removeHandler(handler)
        ot.shutdown()
    (state,) = _states(tmp_path / "ours")
    assert state.format == "otel-train" and not (tmp_path / "dump").exists()
    spans = [(s.name, s.step, s.status) for s in state.spans]
    assert spans == [("step", 1, "ok"), ("fetching_batch", 1, "ok"), ("fwd_bwd", 1, "error"),
                     ("step", 2, "ok"), ("fetching_batch", 2, "ok"), ("fwd_bwd", 2, "error")]
    by_id = {s.span_id: s for s in state.spans}
    assert all(by_id[s.parent_span_id].name == "step" for s in state.spans if s.name != "step")
    errors = [s.error for s in state.spans if s.status == "error"]
    assert [(e["type"], e["message"]) for e in errors] == [("ValueError", "first"), ("ValueError", "bad batch")]
    assert [(s.step, s.values) for s in state.scalars] == [(1, {"loss": 2.5}), (2, {"loss": 2.5})]
    assert "checkpoint_saved" in [i.name for i in state.instants]


def test_without_a_save_path_it_writes_in_their_dump_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRAIN_SAVE_PATH", raising=False)
    logger = _logger("test.titan.structured2")
    handler = register_handler(structured_logger=logger, rank=0, source="training", output_dir=str(tmp_path))
    try:
        with _Span(logger, "step", 1):
            pass
    finally:
        logger.removeHandler(handler)
        ot.shutdown()
    (state,) = _states(tmp_path)
    assert [s.name for s in state.spans] == ["step"]


def test_importing_it_imports_no_framework_and_no_torch() -> None:
    code = "import sys, otel_train.titan; print([m for m in ('torch', 'torchtitan', 'lightning') if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


_REAL = """
import os, torch, torch.distributed as dist
import torchtitan.observability.structured_logger as sl
sl.init_structured_logger(source="training", output_dir=os.environ["DUMP"], rank=0)
dist.init_process_group("gloo", rank=0, world_size=1)   # after the factory, as in torchtitan's train.main
for step in (1, 2):
    sl.set_step(step)
    with sl.log_trace_span("step"):
        with sl.log_trace_span("fwd_bwd"):
            dist.all_reduce(torch.ones(4))
        sl.log_trace_scalar({"loss": 1.0 / step})
dist.destroy_process_group()
"""


def test_torchtitans_logger_with_both_factories_records_the_collectives(tmp_path: Path) -> None:
    titan = titan_env.python()
    if titan is None:
        pytest.skip(titan_env.MISSING)
    env = {**os.environ, "DUMP": str(tmp_path), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "TITAN_STRUCT_LOGGER_HANDLERS": "torchtitan.observability.structured_logger.jsonl_handler."
                                           "register_jsonl_handler,otel_train.titan.register_handler"}
    env.pop("OTEL_TRAIN_SAVE_PATH", None)
    subprocess.run([str(titan), "-c", textwrap.dedent(_REAL)], env=env, check=True, timeout=120)
    states = {s.format: s for s in _states(tmp_path)}
    assert set(states) == {"otel-train", "torchtitan"}
    ours = states["otel-train"]
    names = [s.name for s in ours.spans]
    assert names.count("step") == 2 and names.count("fwd_bwd") == 2
    comm = [s for s in ours.spans if s.name.startswith("comm.")]
    assert len(comm) == 2  # from the first step: the recorder was in place before the group was made
    by_id = {s.span_id: s for s in ours.spans}
    assert all(by_id[c.parent_span_id].name == "fwd_bwd" for c in comm)
    assert ours.ended_cleanly
    assert [s.name for s in states["torchtitan"].spans].count("fwd_bwd") == 2
