"""End to end: ``ot.init`` with ``OTEL_TRACES_EXPORTER=jsonl,otlp`` sends the same spans to a real OTLP
receiver (gRPC and HTTP) as it writes to the JSONL file; an unreachable collector never holds shutdown."""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import pytest
from otlp_receivers import BlackHoleServer, GrpcOtlpReceiver, HttpOtlpReceiver, refused_endpoint

import otel_train as ot


def jsonl_records(save_path: Path) -> list[dict]:
    (path,) = glob.glob(str(save_path / "structured_logs" / "*.jsonl"))
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def traced_loop(steps: int = 3) -> None:
    for step in range(steps):
        with ot.training_step(step, epoch=0):
            with ot.log_trace_span("forward", layer="all"):
                ot.log_trace_instant("marker", n=step)
            with ot.log_trace_span("backward"):
                pass


@pytest.mark.parametrize("receiver_cls, protocol", [(GrpcOtlpReceiver, "grpc"), (HttpOtlpReceiver, "http/protobuf")])
def test_otlp_receives_the_same_spans_as_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               receiver_cls: type, protocol: str) -> None:
    with receiver_cls() as rx:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jsonl,otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer sekrit-token")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "unit-train")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "e2e-run")
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        ot.init(save_path=tmp_path, enabled=True)
        traced_loop()
        ot.shutdown(timeout_s=10)
        received = rx.wait_for(9, timeout=10)
    recs = jsonl_records(tmp_path)
    ends = {r["span_id"]: r for r in recs if r["kind"] == "span_end"}
    assert len(ends) == 9
    by_id = {s["span_id"]: s for s in received}
    assert set(by_id) == set(ends)
    for span_id, rec in ends.items():
        got = by_id[span_id]
        assert got["name"] == rec["name"] and got["trace_id"] == rec["trace_id"]
        assert got["parent_span_id"] == rec.get("parent_span_id")
        assert got["attributes"]["training.step"] == rec["step"]
        assert got["resource"]["training.rank"] == 1 and got["resource"]["training.world_size"] == 2
        assert got["resource"]["service.name"] == "unit-train"
        assert got["resource"]["training.run_id"] == "e2e-run"
        assert abs(got["end_time_unix_nano"] / 1e9 - rec["ts"]) < 1e-5
    forward = [s for s in received if s["name"] == "forward"]
    assert all(s["attributes"]["layer"] == "all" for s in forward)
    # JSONL attrs hold the user's attributes only; the training.* copies are for OTLP.
    assert all(r.get("attrs") == {"layer": "all"} for r in recs if r.get("name") == "forward")
    text = "".join(open(p).read() for p in glob.glob(str(tmp_path / "structured_logs" / "*")))
    assert "sekrit-token" not in text


@pytest.mark.parametrize("where", ["refused", "black_hole"])
def test_shutdown_is_bounded_when_collector_is_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture, where: str) -> None:
    hole = BlackHoleServer() if where == "black_hole" else None
    try:
        endpoint = hole.start().endpoint if hole else refused_endpoint()
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jsonl,otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        ot.init(save_path=tmp_path, enabled=True)
        traced_loop(5)
        started = time.monotonic()
        ot.shutdown(timeout_s=1.5)
        elapsed = time.monotonic() - started
    finally:
        if hole:
            hole.stop()
    assert elapsed < 2.5, f"shutdown took {elapsed:.1f}s"
    recs = jsonl_records(tmp_path)
    assert sum(r["kind"] == "span_end" for r in recs) == 15  # the file has every span regardless
    (dropped,) = [r for r in recs if r["name"] == "otel_train.spans_dropped"]
    assert dropped["attrs"]["count"] == 15
    assert recs[-1]["name"] == "process_end" and recs[-1]["attrs"]["spans_dropped"] == 15
    err = capfd.readouterr().err
    assert err.count("could not be exported") == 1


def test_otlp_only_writes_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with GrpcOtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        ot.init(save_path=tmp_path, enabled=True)
        traced_loop(1)
        ot.shutdown(timeout_s=10)
        assert {s["name"] for s in rx.wait_for(3)} == {"step", "forward", "backward"}
    assert not glob.glob(str(tmp_path / "structured_logs" / "*.jsonl"))


def test_sampling_thins_otlp_but_not_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with GrpcOtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jsonl,otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
        ot.init(save_path=tmp_path, enabled=True)
        traced_loop(2)
        ot.shutdown(timeout_s=10)
        time.sleep(0.2)
        assert rx.spans() == []
    assert sum(r["kind"] == "span_end" for r in jsonl_records(tmp_path)) == 6
