"""End to end against Arize Phoenix: in-process OTLP export from a 2-rank run, and ``otel-train push``.

Phoenix keeps span attributes, events, ids and times, and uses the resource only to pick the project
(``openinference.project.name``): ranks are therefore checked through the span ids each rank's JSONL
file holds (the exact resource attributes are checked against plain receivers in test_push.py).
Phoenix keys spans by span id across projects, so the push test traces a second run of its own.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

from otel_train import schema
from otel_train.analysis.records import Reader, find_process_files
from tests.phoenix import GRPC_ENDPOINT, HTTP_ENDPOINT, PhoenixServer, phoenix  # noqa: F401 - fixture

OTEL_TRAIN = str(Path(sys.executable).parent / "otel-train")
STEPS = 3
WORLD = 2

_RANK = textwrap.dedent(
    """
    import time
    import otel_train as ot
    ot.init()
    for step in range(1, %d + 1):
        with ot.training_step(step):
            with ot.log_trace_span("forward"):
                time.sleep(0.003)
            with ot.log_trace_span("backward", layers=2):
                ot.log_trace_instant("grad_ready", bucket=0)
                time.sleep(0.003)
    ot.shutdown()
    """
    % STEPS
)


def _train(server: PhoenixServer, run_dir: Path, run_id: str, exporters: str, project: str) -> None:
    """WORLD ranks as torchrun would start them, each its own process, all inside Phoenix's namespace."""
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "TORCHELASTIC_RUN_ID": run_id,
            "OTEL_TRAIN_ENABLED": "true", "OTEL_TRAIN_SAVE_PATH": str(run_dir),
            "OTEL_TRACES_EXPORTER": exporters,
            "OTEL_EXPORTER_OTLP_ENDPOINT": GRPC_ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
        }
        procs.append(server.popen([sys.executable, "-c", _RANK], env=env))
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err


def _expected(run_dir: Path) -> dict[str, dict]:
    """span_id -> what the JSONL files say about it (rank from the file it is in)."""
    reader = Reader()
    out: dict[str, dict] = {}
    for pf in find_process_files(run_dir):
        for rec in reader.records(pf):
            sid = rec.get(schema.SPAN_ID)
            if rec[schema.KIND] == schema.SPAN_START:
                out[sid] = {"name": rec[schema.NAME], "parent": rec.get(schema.PARENT_SPAN_ID),
                            "trace_id": rec[schema.TRACE_ID], "start": rec[schema.TS], "rank": pf.rank,
                            "step": rec.get(schema.STEP), "events": []}
            elif rec[schema.KIND] == schema.SPAN_END:
                out[sid]["end"] = rec[schema.TS]
                out[sid]["status"] = rec[schema.STATUS]
            elif rec[schema.KIND] == schema.INSTANT and sid in out:
                out[sid]["events"].append(rec[schema.NAME])
    assert reader.malformed_lines == 0
    return out


def _wait_spans(server: PhoenixServer, project: str, n: int, timeout: float = 60.0) -> list[dict]:
    """Phoenix inserts asynchronously: poll until ``n`` spans are stored (or return what there is)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = server.spans(project)
        if len(spans) >= n or time.monotonic() > deadline:
            return spans
        time.sleep(1.0)


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _check(stored: list[dict], expected: dict[str, dict], *, time_tolerance_s: float) -> None:
    by_id = {s["context"]["span_id"]: s for s in stored}
    assert len(by_id) == len(stored) == len(expected) == WORLD * STEPS * 3
    assert set(by_id) == set(expected)
    for sid, exp in expected.items():
        got = by_id[sid]
        assert got["name"] == exp["name"]
        assert got["parent_id"] == exp["parent"]
        assert got["context"]["trace_id"] == exp["trace_id"]
        assert got["attributes"][schema.ATTR_STEP] == exp["step"]
        assert abs(_ts(got["start_time"]) - exp["start"]) <= time_tolerance_s
        assert abs(_ts(got["end_time"]) - exp["end"]) <= time_tolerance_s
        assert [e["name"] for e in got["events"]] == exp["events"]
    # one trace per step across ranks: step N of every rank shares one trace id, steps differ
    traces: dict[int, set[str]] = {}
    ranks_in: dict[str, set[int]] = {}
    for exp in expected.values():
        traces.setdefault(exp["step"], set()).add(exp["trace_id"])
        ranks_in.setdefault(exp["trace_id"], set()).add(exp["rank"])
    assert sorted(traces) == list(range(1, STEPS + 1))
    assert all(len(ids) == 1 for ids in traces.values()), traces
    assert len({next(iter(ids)) for ids in traces.values()}) == STEPS
    assert all(ranks == set(range(WORLD)) for ranks in ranks_in.values())
    # each step span is a root holding its rank's forward and backward
    for sid, exp in expected.items():
        if exp["name"] != "step":
            parent = expected[exp["parent"]]
            assert parent["name"] == "step" and parent["rank"] == exp["rank"] and parent["step"] == exp["step"]


def test_in_process_export_reaches_phoenix(phoenix: PhoenixServer, tmp_path: Path) -> None:
    _train(phoenix, tmp_path, "phx-inproc", "jsonl,otlp", "inproc")
    expected = _expected(tmp_path)
    stored = _wait_spans(phoenix, "inproc", len(expected))
    # the OTLP span and its JSONL records are stamped a few microseconds apart
    _check(stored, expected, time_tolerance_s=0.005)


def test_push_replays_a_run_into_phoenix_once(phoenix: PhoenixServer, tmp_path: Path) -> None:
    _train(phoenix, tmp_path, "phx-push", "jsonl", "unused")
    expected = _expected(tmp_path)
    env = {**os.environ, "OTEL_RESOURCE_ATTRIBUTES": "openinference.project.name=pushed"}
    with_password = HTTP_ENDPOINT.replace("://", "://trainer:pw-not-printed@")  # sent as Basic auth
    http = phoenix.run([OTEL_TRAIN, "push", str(tmp_path), "--endpoint", with_password,
                        "--protocol", "http/protobuf", "--header", "x-test-token=not-printed"], env=env)
    assert http.returncode == 0, http.stderr
    assert f"pushed {len(expected)} spans (0 incomplete) from {WORLD} processes" in http.stdout
    assert "not-printed" not in http.stdout + http.stderr
    assert f"to {HTTP_ENDPOINT}/v1/traces" in http.stdout
    stored = _wait_spans(phoenix, "pushed", len(expected))
    _check(stored, expected, time_tolerance_s=1e-6)  # replayed times are the records' own
    assert phoenix.spans("unused") == []  # jsonl only: nothing left the training processes

    # Same ids again, over gRPC this time: Phoenix keeps one copy of each span.
    grpc = phoenix.run([OTEL_TRAIN, "push", str(tmp_path), "--endpoint", GRPC_ENDPOINT], env=env)
    assert grpc.returncode == 0, grpc.stderr
    time.sleep(2.0)
    again = phoenix.spans("pushed")
    assert sorted(s["context"]["span_id"] for s in again) == sorted(expected)
