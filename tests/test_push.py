"""OTLP replay: records -> OTLP spans, pushed to real loopback receivers; OTLP/JSON export; ``push --follow``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from otel_train import schema
from otel_train.analysis.otlp_replay import (
    INCOMPLETE_ATTR,
    PushError,
    export_otlp_json,
    follow,
    make_sender,
    parse_headers,
    replay,
)
from otel_train.analysis.records import Reader, TraceReadError
from otel_train.phases import BACKWARD, FORWARD, STEP
from tests.analysis_fixtures import Proc, write_run
from tests.otlp_receivers import GrpcOtlpReceiver, HttpOtlpReceiver, refused_endpoint

ROOT = Path(__file__).resolve().parent.parent
OTEL_TRAIN = str(Path(sys.executable).parent / "otel-train")  # the installed console script
SECRET = "s3cr3t-token-value"


def _run(tmp_path: Path) -> tuple[Path, list[Proc]]:
    """Two ranks: rank 0 finishes cleanly (with an error step, instants and scalars), rank 1 dies mid-step."""
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


def _expected(procs: list[Proc]) -> dict[str, dict]:
    """span_id -> {name, parent, trace_id, start ts, end ts or None, rank} straight from the records."""
    out: dict[str, dict] = {}
    for proc in procs:
        for line in proc.lines:
            rec = json.loads(line)
            if rec[schema.KIND] == schema.SPAN_START:
                out[rec[schema.SPAN_ID]] = {
                    "name": rec[schema.NAME], "parent": rec.get(schema.PARENT_SPAN_ID),
                    "trace_id": rec[schema.TRACE_ID], "start": rec[schema.TS], "end": None,
                    "rank": proc.rank, "last_ts": json.loads(proc.lines[-1])[schema.TS],
                }
            elif rec[schema.KIND] == schema.SPAN_END:
                out[rec[schema.SPAN_ID]]["end"] = rec[schema.TS]
                out[rec[schema.SPAN_ID]]["status"] = rec[schema.STATUS]
    return out


def _check_spans(received: list[dict], procs: list[Proc]) -> None:
    expected = _expected(procs)
    by_id = {s["span_id"]: s for s in received}
    assert set(by_id) == set(expected)
    for sid, exp in expected.items():
        got = by_id[sid]
        assert got["name"] == exp["name"]
        assert got["trace_id"] == exp["trace_id"]
        assert got["parent_span_id"] == exp["parent"]
        assert got["start_time_unix_nano"] == round(exp["start"] * 1e9)
        end = exp["end"] if exp["end"] is not None else exp["last_ts"]
        assert got["end_time_unix_nano"] == round(end * 1e9)
        assert got["resource"][schema.RES_RANK] == exp["rank"]
        assert got["resource"][schema.RES_SERVICE_NAME] == "otel-train"
        assert got["resource"][schema.RES_RUN_ID] == "run-1"
        assert got["resource"][schema.RES_HOST] == ("nodeA" if exp["rank"] == 0 else "nodeB")
        unclosed = exp["end"] is None or exp.get("status") == schema.STATUS_INCOMPLETE
        assert got["attributes"].get(INCOMPLETE_ATTR, False) is unclosed, exp
        assert got["status_code"] == (2 if exp.get("status") == schema.STATUS_ERROR else 0)


@pytest.mark.parametrize("receiver_cls,protocol", [(GrpcOtlpReceiver, "grpc"), (HttpOtlpReceiver, "http/protobuf")])
def test_replay_sends_every_span_with_original_ids(tmp_path: Path, receiver_cls, protocol: str) -> None:
    run, procs = _run(tmp_path)
    with receiver_cls() as rx:
        sender = make_sender(rx.endpoint, protocol, {"authorization": f"Bearer {SECRET}"})
        stats = replay(run, sender, batch_spans=7)
        sender.close()
        received = rx.wait_for(stats.spans)
        assert all(h.get("authorization") == f"Bearer {SECRET}" for h in rx.headers())
    _check_spans(received, procs)
    assert stats.processes == 2 and stats.requests >= stats.spans // 7
    assert stats.incomplete_spans == 2  # rank 1's step and forward, never ended
    assert stats.scalars_skipped == 1


def test_events_context_attributes_and_errors(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    export = tmp_path / "out.json"  # the receivers' flat dicts carry no events: read them from OTLP/JSON
    export_otlp_json(run, export)
    data = json.loads(export.read_text())
    spans = [s for rs in data["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    step4 = next(s for s in spans if s["name"] == STEP and _attr(s, schema.ATTR_STEP) == "4")
    (event,) = step4["events"]
    assert event["name"] == "loss_spike"
    assert event["attributes"] == [{"key": "value", "value": {"doubleValue": 9.5}}]
    failed = next(s for s in spans if s["name"] == FORWARD and _attr(s, schema.ATTR_STEP) == "5")
    assert failed["status"] == {"code": 2, "message": "ValueError: bad batch"}
    assert failed["events"][0]["name"] == "exception"
    assert _attr(failed, schema.ATTR_EPOCH) == "0"


def _attr(span: dict, key: str) -> str | None:
    for kv in span.get("attributes", []):
        if kv["key"] == key:
            return str(next(iter(kv["value"].values())))
    return None


def test_otlp_json_export_matches_the_records(tmp_path: Path) -> None:
    run, procs = _run(tmp_path)
    out = tmp_path / "analysis" / "trace.otlp.json"
    n = export_otlp_json(run, out)
    data = json.loads(out.read_text())
    assert len(data["resourceSpans"]) == 2
    spans = [s for rs in data["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert n == len(spans) == len(_expected(procs))
    expected = _expected(procs)
    for s in spans:
        assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16  # hex, not base64
        assert s["traceId"] == expected[s["spanId"]]["trace_id"]
        assert s.get("parentSpanId", "") == (expected[s["spanId"]]["parent"] or "")
        assert s["kind"] == 1  # integer enums, as OTLP/JSON requires
        assert int(s["startTimeUnixNano"]) == round(expected[s["spanId"]]["start"] * 1e9)
    res = {kv["key"]: kv["value"] for kv in data["resourceSpans"][1]["resource"]["attributes"]}
    assert res[schema.RES_RANK] == {"intValue": "1"}


def test_otlp_json_filters(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    out = tmp_path / "f.json"
    n = export_otlp_json(run, out, ranks={1}, steps=(2, 3))
    data = json.loads(out.read_text())
    (rs,) = data["resourceSpans"]
    spans = rs["scopeSpans"][0]["spans"]
    assert n == len(spans) == 2 * 5  # steps 2 and 3: step + 4 phases each
    assert {_attr(s, schema.ATTR_STEP) for s in spans} == {"2", "3"}


def test_bad_path_and_endpoint_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(TraceReadError, match="no trace files"):
        replay(tmp_path, make_sender("http://127.0.0.1:1", "grpc", {}))
    with pytest.raises(PushError, match="protocol 'udp'"):
        make_sender("http://127.0.0.1:1", "udp", {})
    with pytest.raises(PushError, match="expected KEY=VALUE") as info:
        parse_headers([SECRET])
    assert SECRET not in str(info.value)
    assert parse_headers(["a=1,b=x%3Dy", "c=3"]) == {"a": "1", "b": "x=y", "c": "3"}


def test_unreachable_endpoint_fails_cleanly(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    for protocol in ("http/protobuf", "grpc"):
        sender = make_sender(refused_endpoint(), protocol, {"x-api-key": SECRET}, 0.5, (0.05, 0.05))
        t0 = time.monotonic()
        with pytest.raises(PushError, match="export failed") as info:
            replay(run, sender)
        assert SECRET not in str(info.value) and "\n" not in str(info.value)
        assert time.monotonic() - t0 < 5


def test_replay_twice_sends_identical_spans(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    with GrpcOtlpReceiver() as rx:
        first = replay(run, make_sender(rx.endpoint, "grpc", {}))
        second = replay(run, make_sender(rx.endpoint, "grpc", {}))
        spans = rx.wait_for(first.spans + second.spans)
    key = lambda s: (s["span_id"], s["start_time_unix_nano"], s["end_time_unix_nano"])  # noqa: E731
    once = sorted(map(key, spans[: first.spans]))
    assert once == sorted(map(key, spans[first.spans :]))


# --- follow: a writer process appends while the tailer ships --------------------------------------

_WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    logs = Path(sys.argv[1]); lines = json.loads(Path(sys.argv[2]).read_text()); gate = Path(sys.argv[3])
    name = sys.argv[4]; per_segment = 9
    active = logs / name
    written = 0
    def rotate():
        for i in (2, 1):
            src = logs / (name + ("" if i == 1 else f".{i-1}"))
            if src.exists():
                os.replace(src, logs / f"{name}.{i}")
    fd = os.open(active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for i, line in enumerate(lines):
        if i == len(lines) // 2:
            while not gate.exists():   # wait until the tailer has shipped the first half
                time.sleep(0.05)
        if written == per_segment:
            os.close(fd); rotate(); fd = os.open(active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644); written = 0
        data = (line + "\\n").encode()
        os.write(fd, data[:10]); time.sleep(0.01); os.write(fd, data[10:])   # a line caught half-written
        written += 1
        time.sleep(0.01)
    os.close(fd)
    """
)


def test_follow_ships_spans_while_a_writer_appends_and_rotates(tmp_path: Path) -> None:
    proc = Proc(rank=0)
    proc.steps(range(1, 7))
    proc.shutdown()
    logs = tmp_path / "structured_logs"
    logs.mkdir()
    lines_file = tmp_path / "lines.json"
    lines_file.write_text(json.dumps(proc.lines))
    gate = tmp_path / "gate"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(logs), str(lines_file), str(gate), proc.file_name])
    expected = _expected([proc])
    first_half = {json.loads(l)[schema.SPAN_ID] for l in proc.lines[: len(proc.lines) // 2]
                  if json.loads(l)[schema.KIND] == schema.SPAN_END}
    with GrpcOtlpReceiver() as rx:
        result = {}
        tail = threading.Thread(target=lambda: result.update(stats=follow(
            tmp_path, make_sender(rx.endpoint, "grpc", {}), poll_s=0.05, idle_exit_s=3.0)))
        tail.start()
        # spans of the first half arrive while the writer still waits on the gate: shipped as they end
        rx.wait_for(len(first_half), timeout=20)
        assert writer.poll() is None
        gate.touch()
        assert writer.wait(timeout=30) == 0
        tail.join(timeout=30)
        assert not tail.is_alive()
        spans = rx.spans()
    assert (logs / (proc.file_name + ".1")).exists(), "the writer rotated"
    assert sorted(s["span_id"] for s in spans) == sorted(expected)  # each exactly once, none lost
    _check_spans_single(spans, expected)
    assert result["stats"].malformed_lines == 0 and result["stats"].incomplete_spans == 0


def _check_spans_single(spans: list[dict], expected: dict[str, dict]) -> None:
    for s in spans:
        exp = expected[s["span_id"]]
        assert s["parent_span_id"] == exp["parent"] and s["name"] == exp["name"]
        assert s["end_time_unix_nano"] == round(exp["end"] * 1e9)


def test_push_cli_follow_idle_exit_and_open_spans(tmp_path: Path) -> None:
    proc = Proc(rank=3)
    proc.steps([1])
    proc.stop_inside(2, [BACKWARD])
    write_run(tmp_path, [proc])
    with HttpOtlpReceiver() as rx:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {SECRET}"}
        result = subprocess.run(
            [OTEL_TRAIN, "push", str(tmp_path), "--endpoint", rx.endpoint,
             "--protocol", "http/protobuf", "--follow", "--idle-exit", "0.5", "--poll", "0.1"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        spans = rx.spans()
        headers = rx.headers()
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert all(h.get("authorization") == f"Bearer {SECRET}" for h in headers)
    assert "pushed 7 spans (2 incomplete)" in result.stdout
    open_ones = [s for s in spans if s["attributes"].get(INCOMPLETE_ATTR)]
    assert {s["name"] for s in open_ones} == {STEP, BACKWARD}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OTEL_TRAIN, *args], capture_output=True, text=True, timeout=60)


def test_push_cli_replays_and_reports(tmp_path: Path) -> None:
    run, procs = _run(tmp_path)
    with GrpcOtlpReceiver() as rx:
        result = _cli("push", str(run), "--endpoint", rx.endpoint, "--header", f"x-token={SECRET}")
        spans = rx.spans()
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    n = len(_expected(procs))
    assert result.stdout.startswith(f"pushed {n} spans (2 incomplete) from 2 processes")
    assert "1 scalars skipped" in result.stdout and SECRET not in result.stdout
    _check_spans(spans, procs)


def test_push_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    missing = _cli("push", str(tmp_path / "nope"), "--endpoint", "http://127.0.0.1:4317")
    empty = _cli("push", str(tmp_path), "--endpoint", "http://127.0.0.1:4317")
    bad_header = _cli("push", str(tmp_path), "--endpoint", "http://127.0.0.1:4317", "--header", SECRET)
    for result in (missing, empty, bad_header):
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr and SECRET not in result.stderr
    assert "no such directory" in missing.stderr and "no trace files" in empty.stderr
