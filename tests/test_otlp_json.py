"""OTLP/JSON export (``otel_train.analysis.export.otlp_json.write``): the SDK spans push sends, as OTLP/JSON.

Checked against the records the fixture wrote, and decoded back with protobuf's ``json_format`` into an
``ExportTraceServiceRequest`` (after turning OTLP/JSON's hex ids back into protobuf JSON's base64).
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_train import schema
from otel_train.analysis.export import otlp_json
from otel_train.analysis.records import Reader
from otel_train.analysis.spans import iter_processes
from otel_train.phases import FORWARD, STEP
from tests.analysis_fixtures import Proc, write_run


def _run(tmp_path: Path) -> tuple[Path, list[Proc]]:
    """Rank 0 finishes cleanly (an error step, an instant, a scalar); rank 1 dies inside step 4's forward."""
    r0 = Proc(rank=0, host="nodeA", pid=101)
    r0.steps(range(1, 4))
    r0.set_step(4)
    r0.start(STEP)
    r0.advance(2)
    r0.instant("loss_spike", value=9.5)
    r0.scalar({"loss": 1.5})
    r0.advance(2)
    r0.end()
    r0.fail(5, FORWARD, "ValueError", "bad batch")
    r0.shutdown()
    r1 = Proc(rank=1, host="nodeB", pid=202)
    r1.steps(range(1, 4))
    r1.stop_inside(4, [FORWARD])
    write_run(tmp_path, [r0, r1], lines_per_segment=17)
    return tmp_path, [r0, r1]


def _records(procs: list[Proc]) -> dict[str, dict]:
    """span_id -> start record, with the end record's ts/status and the process's last ts."""
    out: dict[str, dict] = {}
    for proc in procs:
        last = json.loads(proc.lines[-1])[schema.TS]
        for line in map(json.loads, proc.lines):
            if line[schema.KIND] == schema.SPAN_START:
                out[line[schema.SPAN_ID]] = {**line, "end": None, "last_ts": last}
            elif line[schema.KIND] == schema.SPAN_END:
                out[line[schema.SPAN_ID]].update(end=line[schema.TS], status=line[schema.STATUS])
    return out


def _export(run: Path, **filters) -> tuple[dict, otlp_json.Counts]:
    buf = io.BytesIO()
    counts = otlp_json.write(iter_processes(run, Reader(), **filters), buf)
    return json.loads(buf.getvalue()), counts


def _spans(data: dict) -> list[dict]:
    return [s for rs in data["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


def _attr(span: dict, key: str) -> str | None:
    for kv in span.get("attributes", []):
        if kv["key"] == key:
            return str(next(iter(kv["value"].values())))
    return None


def test_spans_match_the_records(tmp_path: Path) -> None:
    run, procs = _run(tmp_path)
    data, counts = _export(run)
    expected = _records(procs)
    spans = _spans(data)
    assert len(data["resourceSpans"]) == counts.processes == 2
    assert counts.slices == len(spans) == len(expected)
    assert counts.instants == 1 and counts.counters == 0
    for s in spans:
        exp = expected[s["spanId"]]
        assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16  # hex, not base64
        assert s["traceId"] == exp[schema.TRACE_ID]
        assert s.get("parentSpanId", "") == (exp.get(schema.PARENT_SPAN_ID) or "")
        assert s["name"] == exp[schema.NAME]
        assert s["kind"] == 1  # integer enums, as OTLP/JSON requires
        assert int(s["startTimeUnixNano"]) == round(exp[schema.TS] * 1e9)
        end = exp["end"] if exp["end"] is not None else exp["last_ts"]
        assert int(s["endTimeUnixNano"]) == round(end * 1e9)
        assert (_attr(s, schema.ATTR_INCOMPLETE) == "True") is (exp["end"] is None)
        assert _attr(s, schema.ATTR_STEP) == (str(exp[schema.STEP]) if schema.STEP in exp else None)
    res = {kv["key"]: kv["value"] for kv in data["resourceSpans"][1]["resource"]["attributes"]}
    assert res[schema.RES_RANK] == {"intValue": "1"}
    assert res[schema.RES_HOST] == {"stringValue": "nodeB"}
    assert res[schema.RES_SERVICE_NAME] == {"stringValue": "otel-train"}


def test_events_context_attributes_and_errors(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    spans = _spans(_export(run)[0])
    step4 = next(s for s in spans if s["name"] == STEP and _attr(s, schema.ATTR_STEP) == "4")
    (event,) = step4["events"]
    assert event["name"] == "loss_spike"
    assert event["attributes"] == [{"key": "value", "value": {"doubleValue": 9.5}}]
    failed = next(s for s in spans if s["name"] == FORWARD and _attr(s, schema.ATTR_STEP) == "5")
    assert failed["status"] == {"code": 2, "message": "ValueError: bad batch"}
    assert failed["events"][0]["name"] == "exception"
    assert _attr(failed, "exception.type") is None  # on the event, not the span
    assert {kv["key"] for kv in failed["events"][0]["attributes"]} == {"exception.type", "exception.message"}
    assert _attr(failed, schema.ATTR_EPOCH) == "0"
    assert _attr(failed, "thread.id") is not None


def test_filters(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    data, counts = _export(run, ranks={1}, steps=(2, 3))
    (rs,) = data["resourceSpans"]
    spans = rs["scopeSpans"][0]["spans"]
    assert counts.slices == len(spans) == 2 * 5  # steps 2 and 3: step + 4 phases each
    assert {_attr(s, schema.ATTR_STEP) for s in spans} == {"2", "3"}


def test_round_trips_through_protobuf_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes as an ExportTraceServiceRequest; a process bigger than one chunk is still one entry."""
    monkeypatch.setattr(otlp_json, "CHUNK_SPANS", 4)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=from-env")
    run, procs = _run(tmp_path)
    data, counts = _export(run)
    for span in _spans(data):
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in span:
                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    request = json_format.ParseDict(data, ExportTraceServiceRequest())
    assert len(request.resource_spans) == 2
    got = {s.span_id.hex(): s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert set(got) == set(_records(procs)) and len(got) == counts.slices
    for sid, exp in _records(procs).items():
        assert got[sid].trace_id.hex() == exp[schema.TRACE_ID]
        assert got[sid].parent_span_id.hex() == (exp.get(schema.PARENT_SPAN_ID) or "")
    res = {kv.key: kv.value.string_value for kv in request.resource_spans[0].resource.attributes}
    assert res["deployment.environment"] == "test" and res[schema.RES_SERVICE_NAME] == "from-env"
    assert request.resource_spans[0].scope_spans[0].scope.name == "otel_train"


def test_no_processes_is_an_empty_request(tmp_path: Path) -> None:
    buf = io.BytesIO()
    assert otlp_json.write([], buf) == otlp_json.Counts(0, 0, 0, 0)
    assert json.loads(buf.getvalue()) == {"resourceSpans": []}


def test_export_cli_writes_otlp_json(tmp_path: Path) -> None:
    """``otel-train export --format otlp-json``: the default output next to the run, filters, one-line errors."""
    cli = str(Path(sys.executable).parent / "otel-train")
    run, procs = _run(tmp_path)
    whole = subprocess.run([cli, "export", str(run), "--format", "otlp-json"], capture_output=True, text=True,
                           timeout=120)
    assert whole.returncode == 0, whole.stderr
    data = json.loads((run / "analysis" / "structured_trace.otlp.json").read_text())
    assert {s["spanId"] for s in _spans(data)} == set(_records(procs))
    out = tmp_path / "one.otlp.json"
    some = subprocess.run([cli, "export", str(run), "-f", "otlp-json", "-o", str(out), "--ranks", "1", "--steps", "2-3"],
                          capture_output=True, text=True, timeout=120)
    assert some.returncode == 0, some.stderr
    assert {_attr(s, schema.ATTR_STEP) for s in _spans(json.loads(out.read_text()))} == {"2", "3"}
    empty = subprocess.run([cli, "export", str(tmp_path / "nothing"), "-f", "otlp-json"], capture_output=True,
                           text=True, timeout=120)
    assert empty.returncode == 2 and empty.stderr.startswith("error: ") and len(empty.stderr.splitlines()) == 1


def test_odd_values_and_ids(tmp_path: Path) -> None:
    """Ints beyond int64 become text, nested objects key-value lists; a span whose id is not hex is skipped."""
    proc = Proc(rank=0)
    proc.set_step(1)
    proc.start(STEP, big=2**70, nested={"a": [1, "x"], "b": None})
    proc.advance(1)
    proc.start(FORWARD)
    proc.advance(1)
    proc.end()
    proc.end()
    sid = json.loads(proc.lines[-2])[schema.SPAN_ID]  # forward's end (step's is last)
    proc.lines = [line.replace(sid, "not-a-hex-id!!!!") for line in proc.lines]
    write_run(tmp_path, [proc])
    data, counts = _export(tmp_path)
    (step,) = _spans(data)
    assert counts.slices == 1
    attrs = {kv["key"]: kv["value"] for kv in step["attributes"]}
    assert attrs["big"] == {"stringValue": str(2**70)}
    assert attrs["nested"] == {"kvlistValue": {"values": [
        {"key": "a", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"stringValue": "x"}]}}},
        {"key": "b", "value": {}}]}}
