"""Handler factories: the SQLite example end to end, factory failures at init, processors and exporters
returned by factories, and record handlers that fail at run time."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_train as ot
from otel_train import schema as S

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "sqlite_handler.py"
EXAMPLE_SPEC = "examples.sqlite_handler:sqlite_records"


@pytest.fixture(autouse=True)
def clean_runtime(monkeypatch: pytest.MonkeyPatch):
    for name in list(os.environ):
        if name.startswith(("OTEL_TRAIN_", "OTEL_TRACES_", "OTEL_EXPORTER_", "OTEL_SDK_")):
            monkeypatch.delenv(name)
    yield
    ot.shutdown()


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RANK", "WORLD_SIZE", "SLURM_"))}
    env.update(extra)
    return env


def _jsonl_records(save_path: Path) -> list[dict]:
    files = sorted((save_path / S.STRUCTURED_LOGS_DIR).glob("*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def _db_records(save_path: Path, rank: int = 0) -> list[dict]:
    db = save_path / S.STRUCTURED_LOGS_DIR / f"records.rank{rank}.sqlite"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT kind, name, step, rank, span_id, parent_span_id, dur_ms, status, record "
                            "FROM records").fetchall()
    records = []
    for kind, name, step, rank_, span_id, parent, dur_ms, status, text in rows:
        record = json.loads(text)
        # The indexed columns agree with the stored record.
        assert (kind, name, step, rank_, span_id, parent, dur_ms, status) == tuple(
            record.get(k) for k in (S.KIND, S.NAME, S.STEP, S.RANK, S.SPAN_ID, S.PARENT_SPAN_ID, S.DUR_MS, S.STATUS))
        records.append(record)
    return records


def _assert_db_matches_jsonl(save_path: Path) -> list[dict]:
    from_file = _jsonl_records(save_path)
    from_db = _db_records(save_path)
    assert len(from_db) == len(from_file)
    assert {r.get(S.SPAN_ID) for r in from_db} == {r.get(S.SPAN_ID) for r in from_file}
    assert sorted(from_db, key=lambda r: r[S.SEQ]) == from_file
    return from_file


def test_example_script_fills_database_like_the_jsonl_file(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path)], cwd=tmp_path, env=_child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    records = _assert_db_matches_jsonl(tmp_path)
    kinds = {r[S.KIND] for r in records}
    assert kinds == {S.SPAN_START, S.SPAN_END, S.INSTANT, S.SCALAR}
    ends = [r for r in records if r[S.KIND] == S.SPAN_END]
    assert len(ends) == 20 * 5 and all(r[S.STATUS] == S.STATUS_OK for r in ends)
    assert "forward" in proc.stdout and f"{len(records)} records" in proc.stdout


def test_example_factory_via_env_var(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import otel_train as ot
        ot.init()
        for step in range(3):
            with ot.training_step(step):
                with ot.log_trace_span("forward"):
                    ot.log_trace_instant("mark", step=step)
        ot.shutdown()
    """)
    env = _child_env(OTEL_TRAIN_ENABLED="1", OTEL_TRAIN_SAVE_PATH=str(tmp_path), OTEL_TRAIN_HANDLERS=EXAMPLE_SPEC)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    records = _assert_db_matches_jsonl(tmp_path)
    assert sum(r[S.KIND] == S.SPAN_END for r in records) == 6


def _init_error(tmp_path: Path, handler: Any) -> str:
    with pytest.raises(ot.ConfigError) as info:
        ot.init(tmp_path, enabled=True, handlers=[handler])
    message = str(info.value)
    assert "\n" not in message
    assert not ot.is_enabled()
    assert not list(tmp_path.rglob("*.jsonl")), "nothing may be written when init fails"
    return message


def test_factory_module_not_found(tmp_path: Path) -> None:
    message = _init_error(tmp_path, "no_such_module_xyz:make")
    assert "no_such_module_xyz:make" in message and "cannot import" in message


def test_factory_attribute_missing(tmp_path: Path) -> None:
    message = _init_error(tmp_path, "json:no_such_factory")
    assert "json:no_such_factory" in message and "no callable 'no_such_factory'" in message


def test_factory_from_env_var_fails_at_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_HANDLERS", "json:no_such_factory")
    with pytest.raises(ot.ConfigError, match="json:no_such_factory"):
        ot.init(tmp_path, enabled=True)
    assert not ot.is_enabled()


def test_factory_that_raises(tmp_path: Path) -> None:
    def exploding_factory(**_: Any) -> None:
        raise RuntimeError("disk on fire")

    message = _init_error(tmp_path, exploding_factory)
    assert "exploding_factory" in message and "RuntimeError: disk on fire" in message


def test_factory_returning_wrong_type(tmp_path: Path) -> None:
    def number_factory() -> int:
        return 42

    message = _init_error(tmp_path, number_factory)
    assert "number_factory" in message and "returned int" in message


def test_init_works_again_after_a_failing_factory(tmp_path: Path) -> None:
    _init_error(tmp_path, "json:no_such_factory")
    ot.init(tmp_path, enabled=True)
    assert ot.is_enabled()


def _run_steps(steps: int = 2) -> None:
    for step in range(steps):
        with ot.training_step(step):
            with ot.log_trace_span("forward"):
                pass


def test_factory_returning_span_processor(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    seen: dict[str, Any] = {}

    def processor_factory(*, rank: int, world_size: int, log_dir: str) -> SimpleSpanProcessor:
        seen.update(rank=rank, world_size=world_size, log_dir=log_dir)
        return SimpleSpanProcessor(memory)

    ot.init(tmp_path, enabled=True, handlers=[processor_factory])
    _run_steps()
    spans = memory.get_finished_spans()
    ot.shutdown()
    assert seen == {"rank": 0, "world_size": 1, "log_dir": str(tmp_path / S.STRUCTURED_LOGS_DIR)}
    assert sorted(s.name for s in spans) == ["forward", "forward", "step", "step"]
    assert sorted(s.attributes[S.ATTR_STEP] for s in spans if s.name == "forward") == [0, 1]


def test_factory_returning_span_exporter(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    ot.init(tmp_path, enabled=True, handlers=[lambda: memory])
    _run_steps(3)
    ot.shutdown()  # the exporter is batched off the training thread; shutdown flushes it
    spans = memory.get_finished_spans()
    assert sorted(s.name for s in spans) == ["forward"] * 3 + ["step"] * 3
    file_ids = {r[S.SPAN_ID] for r in _jsonl_records(tmp_path) if r[S.KIND] == S.SPAN_END}
    assert {format(s.context.span_id, "016x") for s in spans} == file_ids


def test_factory_attaching_its_own_processor(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()

    def attaching_factory(*, tracer_provider: Any) -> None:
        tracer_provider.add_span_processor(SimpleSpanProcessor(memory))

    ot.init(tmp_path, enabled=True, handlers=[attaching_factory])
    _run_steps(1)
    ot.shutdown()
    assert sorted(s.name for s in memory.get_finished_spans()) == ["forward", "step"]


class _FailingHandler:
    def __init__(self) -> None:
        self.calls = 0
        self.shut = False

    def on_record(self, record: dict) -> None:
        self.calls += 1
        raise ValueError("handler bug")

    def shutdown(self) -> None:
        self.shut = True
        raise OSError("cannot close")


def test_record_handler_failing_at_run_time_does_not_break_training(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    handler = _FailingHandler()
    ot.init(tmp_path, enabled=True, handlers=[lambda: handler])
    _run_steps(5)
    ot.log_trace_scalar({"loss": 0.5})
    ot.shutdown()
    records = _jsonl_records(tmp_path)
    assert handler.calls == len(records) > 20  # every record was offered, and the file still has them all
    assert sum(r[S.KIND] == S.SPAN_END for r in records) == 10
    assert records[-1][S.NAME] == S.INSTANT_PROCESS_END
    assert handler.shut
    err = capfd.readouterr().err
    assert err.count("handler bug") == 1, err
    assert "cannot close" in err
