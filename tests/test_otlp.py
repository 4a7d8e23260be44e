"""OTLP wiring: delivery to real loopback receivers, drop counting, bounded shutdown, sampling, errors."""

from __future__ import annotations

import io
import logging
import os
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, TraceIdRatioBased
from otlp_receivers import BlackHoleServer, GrpcOtlpReceiver, HttpOtlpReceiver, refused_endpoint

from otel_train import _report
from otel_train.errors import ConfigError
from otel_train.exporters.otlp import BoundedBatchSpanProcessor, build_span_processors, shutdown_processors

SECRET = "s3cr3t-token-value"
GRPC = "grpc"
HTTP = "http/protobuf"


def _provider(processor: BoundedBatchSpanProcessor) -> TracerProvider:
    provider = TracerProvider(resource=Resource({"service.name": "otlp-test", "training.rank": 3}), sampler=ALWAYS_ON)
    provider.add_span_processor(processor)
    return provider


def _step_trace(provider: TracerProvider, step: int = 0) -> list:
    """A ``step`` span with ``forward`` and ``backward`` children; returns the ended SDK spans."""
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("step", attributes={"training.step": step}) as step_span:
        with tracer.start_as_current_span("forward", attributes={"micro_batch": 2, "loss_scale": 0.5}) as fwd:
            pass
        with tracer.start_as_current_span("backward", attributes={"tags": ("a", "b")}) as bwd:
            pass
    return [step_span, fwd, bwd]


def _only(processors: list[BoundedBatchSpanProcessor]) -> BoundedBatchSpanProcessor:
    assert len(processors) == 1
    return processors[0]


@pytest.mark.parametrize(
    ("protocol", "receiver_cls", "endpoint_key", "extra"),
    [
        (GRPC, GrpcOtlpReceiver, "OTEL_EXPORTER_OTLP_ENDPOINT", {}),
        (HTTP, HttpOtlpReceiver, "OTEL_EXPORTER_OTLP_ENDPOINT", {}),
        (HTTP, HttpOtlpReceiver, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", {"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}),
    ],
    ids=["grpc", "http", "http-traces-endpoint-gzip"],
)
def test_spans_reach_receiver_with_same_ids_and_attributes(protocol, receiver_cls, endpoint_key, extra):
    with receiver_cls() as rx:
        url = rx.traces_url if endpoint_key.endswith("TRACES_ENDPOINT") else rx.endpoint
        env = {endpoint_key: url, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
               "OTEL_EXPORTER_OTLP_HEADERS": "x-run-token=abc123", **extra}
        processor = _only(build_span_processors(("otlp",), env=env))
        provider = _provider(processor)
        sent = _step_trace(provider)
        assert processor.force_flush(5000)
        got = {s["span_id"]: s for s in rx.wait_for(3)}
        provider.shutdown()

    assert processor.exported == 3 and processor.dropped == 0
    for span in sent:
        ctx = span.get_span_context()
        received = got[f"{ctx.span_id:016x}"]
        assert received["name"] == span.name
        assert received["trace_id"] == f"{ctx.trace_id:032x}"
        assert received["parent_span_id"] == (f"{span.parent.span_id:016x}" if span.parent else None)
        assert received["attributes"] == {k: list(v) if isinstance(v, tuple) else v for k, v in span.attributes.items()}
        assert received["resource"]["training.rank"] == 3
        assert received["start_time_unix_nano"] == span.start_time
    assert got[f"{sent[0].get_span_context().span_id:016x}"]["parent_span_id"] is None
    # The SDK exporter read OTEL_EXPORTER_OTLP_HEADERS from our env mapping.
    assert all(h.get("x-run-token") == "abc123" for h in rx.headers())


def test_queue_overflow_counts_drops_without_blocking():
    with BlackHoleServer() as hole:
        exporter = _only(build_span_processors(("otlp",), env={"OTEL_EXPORTER_OTLP_ENDPOINT": hole.endpoint})).exporter
        processor = BoundedBatchSpanProcessor(exporter, max_queue_size=4, max_export_batch_size=2, schedule_delay_ms=10)
        provider = _provider(processor)
        tracer = provider.get_tracer("test")
        slowest = 0.0
        for i in range(200):
            span = tracer.start_span("forward", attributes={"i": i})
            t0 = time.perf_counter()
            span.end()
            slowest = max(slowest, time.perf_counter() - t0)
        # Worker is stuck in an export the black hole never answers: at most queue + one batch survive.
        assert processor.dropped >= 200 - 4 - 2
        assert slowest < 0.25  # a blocking on_end would wait seconds on the black hole
        t0 = time.monotonic()
        processor.shutdown(timeout_s=0.5)
        assert time.monotonic() - t0 < 1.0
    assert processor.exported == 0
    assert processor.dropped == 200


@pytest.mark.parametrize("protocol", [GRPC, HTTP])
@pytest.mark.parametrize("collector", ["refused", "black_hole"])
def test_shutdown_returns_within_timeout_and_counts_undelivered(protocol, collector):
    hole = BlackHoleServer().start() if collector == "black_hole" else None
    try:
        endpoint = hole.endpoint if hole else refused_endpoint()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        processor = _only(build_span_processors(("otlp",), env=env))
        provider = _provider(processor)
        for step in range(2):
            _step_trace(provider, step)
        t0 = time.monotonic()
        processor.shutdown(timeout_s=1.0)
        elapsed = time.monotonic() - t0
    finally:
        if hole:
            hole.stop()
    assert elapsed < 1.5
    assert processor.exported == 0
    assert processor.dropped == 6
    processor.shutdown(timeout_s=1.0)  # idempotent
    assert processor.dropped == 6


def test_shutdown_processors_shares_one_budget():
    with BlackHoleServer() as hole:
        processors = [
            _only(build_span_processors(("otlp",), env={"OTEL_EXPORTER_OTLP_ENDPOINT": hole.endpoint})),
            _only(build_span_processors(("otlp",), env={"OTEL_EXPORTER_OTLP_ENDPOINT": refused_endpoint(),
                                                         "OTEL_EXPORTER_OTLP_PROTOCOL": HTTP})),
        ]
        for processor in processors:
            _step_trace(_provider(processor))
        t0 = time.monotonic()
        shutdown_processors(processors, timeout_s=1.0)
        elapsed = time.monotonic() - t0
    assert elapsed < 1.5  # one budget for both, not one each
    assert [(p.exported, p.dropped) for p in processors] == [(0, 3), (0, 3)]


def test_export_failure_logged_once_and_headers_never_logged(caplog, capsys):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": refused_endpoint(),
        "OTEL_EXPORTER_OTLP_PROTOCOL": HTTP,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "0.5",  # seconds in the Python SDK: fail before the first backoff
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {SECRET}",
    }
    caplog.set_level(logging.DEBUG)
    _report.reset()
    processor = _only(build_span_processors(("otlp",), env=env))
    provider = _provider(processor)
    for step in range(3):
        _step_trace(provider, step)
        processor.force_flush(5000)
    processor.shutdown(timeout_s=1.0)

    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("otel-train:")]
    assert len(ours) == 1, ours  # reported once (on the otel_train logger's stderr handler) ...
    assert "could not export" in ours[0]
    assert _report.counts()["otlp export:OTLPSpanExporter"] == 3  # ... and every failed batch counted
    assert processor.dropped == 9 and processor.exported == 0
    assert SECRET not in caplog.text and SECRET not in ours[0]


@pytest.mark.parametrize("protocol", [GRPC, HTTP])
def test_endpoint_userinfo_and_headers_never_logged(protocol: str, caplog, capsys):
    """Issue 11: the gRPC exporter logs its endpoint, user:password@ included; a bad header is logged whole."""
    endpoint = refused_endpoint().replace("http://", f"http://alice:{SECRET}-pw@")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "0.5",
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET},bad header {SECRET}-2",
    }
    caplog.set_level(logging.DEBUG)
    processor = _only(build_span_processors(("otlp",), env=env))
    _step_trace(_provider(processor))
    processor.force_flush(3000)
    processor.shutdown(timeout_s=1.0)
    logged = caplog.text + capsys.readouterr().err
    assert processor.dropped == 3 and SECRET not in logged, logged


def test_config_error_does_not_leak_headers():
    env = {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {SECRET}", "OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"}
    with pytest.raises(ConfigError) as info:
        build_span_processors(("otlp",), env=env)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("protocol", [GRPC, HTTP])
def test_sampler_ratio_zero_exports_nothing_ratio_one_everything(protocol):
    receiver_cls = GrpcOtlpReceiver if protocol == GRPC else HttpOtlpReceiver
    with receiver_cls() as rx:
        base = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_TRACES_SAMPLER": "traceidratio"}
        none_kept = _only(build_span_processors(("otlp",), env={**base, "OTEL_TRACES_SAMPLER_ARG": "0"}))
        all_kept = _only(build_span_processors(("otlp",), env={**base, "OTEL_TRACES_SAMPLER_ARG": "1"}))
        provider = _provider(none_kept)
        for step in range(4):
            _step_trace(provider, step)
        assert none_kept.force_flush(5000)
        provider.shutdown()
        provider = _provider(all_kept)
        for step in range(4):
            _step_trace(provider, step)
        assert all_kept.force_flush(5000)
        received = rx.wait_for(12)
        provider.shutdown()
    assert (none_kept.exported, none_kept.dropped) == (0, 0)
    assert (all_kept.exported, all_kept.dropped) == (12, 0)
    assert len(received) == 12


def test_ratio_sampler_keeps_or_drops_whole_traces():
    with GrpcOtlpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
               "OTEL_TRACES_SAMPLER_ARG": "0.5"}
        processor = _only(build_span_processors(("otlp",), env=env))
        provider = _provider(processor)
        traces = [_step_trace(provider, step) for step in range(40)]
        assert processor.force_flush(5000)
        provider.shutdown()
        received = rx.spans()
    ratio = TraceIdRatioBased(0.5)
    expected = {
        f"{s.get_span_context().span_id:016x}"
        for trace in traces
        if ratio.should_sample(None, trace[0].get_span_context().trace_id, "step").decision.is_sampled()
        for s in trace
    }
    assert 0 < len(expected) < 120  # 40 random traces at 0.5: both outcomes occur
    assert {s["span_id"] for s in received} == expected
    assert processor.exported == len(expected) and processor.dropped == 0


def test_default_protocol_follows_sdk_and_environ_is_restored(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    before = dict(os.environ)
    grpc_default = _only(build_span_processors(("otlp",), env={}))
    http = _only(build_span_processors(("otlp",), env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": HTTP}))
    assert dict(os.environ) == before
    assert isinstance(grpc_default.exporter, GrpcExporter)
    assert isinstance(http.exporter, HttpExporter)
    for processor in (grpc_default, http):
        processor.shutdown(timeout_s=0.5)


def test_console_exporter():
    processor = _only(build_span_processors(("console",), env={}))
    assert isinstance(processor.exporter, ConsoleSpanExporter)
    # The SDK binds sys.stdout when its module is imported, before pytest's capture: look at its stream.
    processor.exporter.out = io.StringIO()
    provider = _provider(processor)
    _step_trace(provider)
    assert processor.force_flush(5000)
    provider.shutdown()
    assert '"name": "backward"' in processor.exporter.out.getvalue()
    assert processor.exported == 3


@pytest.mark.parametrize(
    ("names", "env", "mentions"),
    [
        (("zipkin",), {}, "zipkin"),
        (("otlp",), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        (("otlp",), {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        (("otlp",), {"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        (("otlp",), {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "0 to 1"),
        (("otlp",), {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "0 to 1"),
        (("console",), {"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, "OTEL_BSP_MAX_QUEUE_SIZE"),
        (("console",), {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "0"}, "max_export_batch_size"),
        (("console",), {"OTEL_BSP_SCHEDULE_DELAY": "-5"}, "schedule_delay_ms"),
        (("otlp",), {"OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"}, "brotli"),
        (("otlp",), {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "OTLP grpc exporter"),
    ],
)
def test_build_errors_are_one_line_config_errors(names, env, mentions):
    with pytest.raises(ConfigError) as info:
        build_span_processors(names, env=env)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert mentions in message
    assert "\n" not in message
