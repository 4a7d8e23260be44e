"""``otel-train push``: the span model's spans through the SDK's OTLP exporters to real loopback receivers.

Python API (``otel_train.analysis.push``) and the CLI; failures (refused, black-holed, untrusted TLS) as
one line naming the endpoint; secrets (headers, URL passwords) planted and looked for in every output;
the ``OTEL_EXPORTER_OTLP_*`` variables read by the SDK. ``--follow``: test_push_follow.py; OTLP/JSON:
test_otlp_json.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_train import schema
from otel_train.analysis.otlp_send import PushError, open_destination, parse_headers
from otel_train.analysis.push import replay
from otel_train.analysis.records import TraceReadError
from tests.analysis_fixtures import Proc, write_run
from tests.otlp_receivers import BlackHoleServer, GrpcOtlpReceiver, HttpOtlpReceiver, refused_endpoint, self_signed_cert
from tests.test_otlp_json import _run

OTEL_TRAIN = str(Path(sys.executable).parent / "otel-train")  # the installed console script
SECRET = "s3cr3t-token-value"
PASSWORD = "hunter2-pa55word"
INCOMPLETE = schema.ATTR_INCOMPLETE
RECEIVERS = [(GrpcOtlpReceiver, "grpc"), (HttpOtlpReceiver, "http/protobuf")]


def _expected(procs: list[Proc]) -> dict[str, dict]:
    """span_id -> {name, parent, trace_id, start ts, end ts or None, rank, events} straight from the records."""
    out: dict[str, dict] = {}
    for proc in procs:
        last = json.loads(proc.lines[-1])[schema.TS]
        for rec in map(json.loads, proc.lines):
            sid = rec.get(schema.SPAN_ID)
            if rec[schema.KIND] == schema.SPAN_START:
                out[sid] = {"name": rec[schema.NAME], "parent": rec.get(schema.PARENT_SPAN_ID),
                            "trace_id": rec[schema.TRACE_ID], "start": rec[schema.TS], "end": None,
                            "rank": proc.rank, "last_ts": last, "events": []}
            elif rec[schema.KIND] == schema.SPAN_END:
                out[sid].update(end=rec[schema.TS], status=rec[schema.STATUS])
            elif rec[schema.KIND] == schema.INSTANT and sid in out:
                out[sid]["events"].append(rec[schema.NAME])
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
        assert got["attributes"].get(INCOMPLETE, False) is unclosed, exp
        error = exp.get("status") == schema.STATUS_ERROR
        assert got["status_code"] == (2 if error else 0)
        assert [e["name"] for e in got["events"]] == exp["events"] + (["exception"] if error else [])


@pytest.mark.parametrize("receiver_cls,protocol", RECEIVERS)
def test_replay_sends_every_span_with_original_ids(tmp_path: Path, receiver_cls, protocol: str) -> None:
    run, procs = _run(tmp_path)
    with receiver_cls() as rx:
        destination = open_destination(rx.endpoint, protocol, {"authorization": f"Bearer {SECRET}"})
        stats = replay(run, destination, batch_spans=7)
        destination.close()
        received = rx.wait_for(stats.spans)
        assert all(h.get("authorization") == f"Bearer {SECRET}" for h in rx.headers())
    _check_spans(received, procs)
    assert stats.processes == 2 and stats.requests == -(-stats.spans // 7)
    assert stats.incomplete_spans == 2  # rank 1's step and forward, never ended
    assert stats.scalars_skipped == 1 and stats.events == 1
    failed = next(s for s in received if s["status_code"] == 2)
    assert failed["status_message"] == "ValueError: bad batch"
    assert failed["events"][-1]["attributes"] == {"exception.type": "ValueError", "exception.message": "bad batch"}


def test_replay_twice_sends_identical_spans(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    with GrpcOtlpReceiver() as rx:
        first = replay(run, open_destination(rx.endpoint, "grpc"))
        second = replay(run, open_destination(rx.endpoint, "grpc"))
        spans = rx.wait_for(first.spans + second.spans)
    key = lambda s: (s["span_id"], s["trace_id"], s["start_time_unix_nano"], s["end_time_unix_nano"])  # noqa: E731
    assert sorted(map(key, spans[: first.spans])) == sorted(map(key, spans[first.spans :]))


def test_bad_path_protocol_and_headers(tmp_path: Path) -> None:
    with pytest.raises(TraceReadError, match="no trace files"):
        replay(tmp_path, open_destination("http://127.0.0.1:1", "grpc"))
    with pytest.raises(PushError, match="--protocol 'udp'"):
        open_destination("http://127.0.0.1:1", "udp")
    with pytest.raises(PushError, match=r"#2: expected KEY=VALUE") as info:
        parse_headers(["a=1", SECRET])
    assert SECRET not in str(info.value)
    assert parse_headers(["a=1,b=x%3Dy", "C=3"]) == {"a": "1", "b": "x=y", "c": "3"}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_refused_and_black_holed_endpoints_fail_in_one_line(tmp_path: Path, protocol: str) -> None:
    run, _ = _run(tmp_path)
    with BlackHoleServer() as hole:
        for endpoint in (refused_endpoint(), hole.endpoint):
            destination = open_destination(endpoint, protocol, {"x-api-key": SECRET}, timeout_s=1.0)
            t0 = time.monotonic()
            with pytest.raises(PushError) as info:
                replay(run, destination)
            destination.close()
            message = str(info.value)
            assert time.monotonic() - t0 < 5  # the SDK's retries stop at --timeout
            assert message.startswith(f"cannot push to {endpoint}") and "\n" not in message
            assert ": Failed to export" in message  # the SDK exporter's reason, each time
            assert SECRET not in message


def test_push_cli_replays_and_reports(tmp_path: Path) -> None:
    run, procs = _run(tmp_path)
    with GrpcOtlpReceiver() as rx:
        result = _cli("push", str(run), "--endpoint", rx.endpoint, "--header", f"x-token={SECRET}")
        spans = rx.spans()
        assert rx.headers()[0]["x-token"] == SECRET
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    n = len(_expected(procs))
    assert result.stdout.startswith(f"pushed {n} spans (2 incomplete) from 2 processes")
    assert "1 scalars skipped" in result.stdout and SECRET not in result.stdout
    _check_spans(spans, procs)


def test_push_cli_reads_the_sdk_variables(tmp_path: Path) -> None:
    """No --endpoint/--protocol/--header: endpoint, protocol, headers and compression come from OTEL_EXPORTER_OTLP_*."""
    run, procs = _run(tmp_path)
    with HttpOtlpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.traces_url,
               "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET},x-team=ml",
               "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip", "OTEL_SERVICE_NAME": "trainer"}
        result = _cli("push", str(run), env=env)
        headers, spans = rx.headers(), rx.spans()
    assert result.returncode == 0, result.stderr
    assert f"to {rx.traces_url}" in result.stdout and SECRET not in result.stdout + result.stderr
    assert {h["content-encoding"] for h in headers} == {"gzip"}
    assert {h["authorization"] for h in headers} == {f"Bearer {SECRET}"}
    assert {h["x-team"] for h in headers} == {"ml"}
    assert {s["resource"][schema.RES_SERVICE_NAME] for s in spans} == {"trainer"}
    assert len(spans) == len(_expected(procs))
    with GrpcOtlpReceiver() as rx:  # gRPC: OTEL_EXPORTER_OTLP_ENDPOINT and the _TRACES_ headers variable
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-key={SECRET}"}
        result = _cli("push", str(run), env=env)
        assert result.returncode == 0, result.stderr
        assert {h["x-key"] for h in rx.headers()} == {SECRET} and len(rx.spans()) == len(spans)


@pytest.mark.parametrize("receiver_cls,protocol", RECEIVERS)
def test_push_cli_over_tls_with_the_certificate_variable(tmp_path: Path, receiver_cls, protocol: str) -> None:
    pair = self_signed_cert(tmp_path)
    if pair is None:
        pytest.skip("no openssl tool to make a test certificate")
    run, procs = _run(tmp_path / "run")
    # requests prefers REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE, when set, over the SDK's certificate (docs/otlp.md)
    no_bundle = {"REQUESTS_CA_BUNDLE": "", "CURL_CA_BUNDLE": ""}
    with receiver_cls(tls=pair) as rx:
        untrusted = _cli("push", str(run), "--endpoint", rx.endpoint, "--protocol", protocol, "--timeout", "2",
                         env=no_bundle)
        trusted = _cli("push", str(run), "--endpoint", rx.endpoint, "--protocol", protocol,
                       env={**no_bundle, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pair[1])})
        spans = rx.spans()
    assert untrusted.returncode == 1 and len(untrusted.stderr.splitlines()) == 1, untrusted.stderr
    assert trusted.returncode == 0, trusted.stderr
    assert len(spans) == len(_expected(procs))


@pytest.mark.parametrize("receiver_cls,protocol", RECEIVERS)
def test_url_password_becomes_basic_auth_and_is_never_printed(tmp_path: Path, receiver_cls, protocol: str) -> None:
    run, _ = _run(tmp_path)
    with receiver_cls() as rx:
        with_password = rx.endpoint.replace("://", f"://trainer:{PASSWORD}@")
        result = _cli("push", str(run), "--endpoint", with_password, "--protocol", protocol)
        headers = rx.headers()
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr and "trainer:" not in result.stdout
    assert {h["authorization"] for h in headers} == {"Basic " + base64.b64encode(f"trainer:{PASSWORD}".encode()).decode()}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_push_cli_refused_or_silent_endpoint_exits_1_naming_it(tmp_path: Path, protocol: str) -> None:
    run, _ = _run(tmp_path)
    env = {"OTEL_EXPORTER_OTLP_HEADERS": f"x-env-token={SECRET}"}
    with BlackHoleServer() as hole:
        for endpoint in (refused_endpoint(), hole.endpoint):
            planted = endpoint.replace("://", f"://trainer:{PASSWORD}@")
            result = _cli("push", str(run), "--endpoint", planted, "--protocol", protocol, "--timeout", "1",
                          "--header", f"authorization=Bearer {SECRET}x", env=env)
            everything = result.stdout + result.stderr
            assert result.returncode == 1, everything
            assert result.stdout == "" and len(result.stderr.splitlines()) == 1, everything
            assert result.stderr.startswith(f"error: cannot push to {endpoint}"), everything
            assert PASSWORD not in everything and SECRET not in everything and "Traceback" not in everything


def test_push_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    missing = _cli("push", str(tmp_path / "nope"), "--endpoint", "http://127.0.0.1:4317")
    empty = _cli("push", str(tmp_path), "--endpoint", "http://127.0.0.1:4317")
    write_run(tmp_path / "run", [Proc(rank=0)])
    bad_header = _cli("push", str(tmp_path / "run"), "--endpoint", "http://127.0.0.1:4317", "--header", SECRET)
    bad_env = _cli("push", str(tmp_path / "run"), env={"OTEL_EXPORTER_OTLP_HEADERS": f"ok=1,{SECRET}"})
    bad_protocol = _cli("push", str(tmp_path / "run"), env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    bad_compression = _cli("push", str(tmp_path / "run"), env={"OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"})
    for result, code in ((missing, 2), (empty, 2), (bad_header, 1), (bad_env, 1), (bad_protocol, 1),
                         (bad_compression, 1)):
        assert result.returncode == code, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
        assert SECRET not in result.stdout + result.stderr
    assert "no such directory" in missing.stderr and "no trace files" in empty.stderr
    assert "--header #1" in bad_header.stderr and "OTEL_EXPORTER_OTLP_HEADERS #1" in bad_env.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL 'http/json'" in bad_protocol.stderr
    assert "brotli" in bad_compression.stderr


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([OTEL_TRAIN, *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})
