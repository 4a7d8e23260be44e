"""An OTLP backend that answers 200 (HTTP) / OK (gRPC) with ``partial_success.rejected_spans`` equal to
every span it was sent: it stored nothing.

``otel-train push`` used to print ``pushed 160 spans`` and exit 0 (documented: exit 0 means every span
was accepted), and the runtime's OTLP processor counted the spans as exported. What must hold
(otel_train/_otlp_partial.py): push exits 1 with one line that counts the rejected spans and quotes the
backend's message, over HTTP and gRPC; the runtime counts them as dropped (``spans_dropped`` in
``process_end``, the ``otel_train.spans_dropped`` instant), over both. The receivers are real
(tests/otlp_receivers.py), on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from analysis_fixtures import Proc, write_run
from faultlib import reported, traces
from otlp_receivers import GrpcOtlpReceiver, HttpOtlpReceiver
from typer.testing import CliRunner

from otel_train import schema as S
from otel_train.cli import app

PROTOCOLS = (("grpc", GrpcOtlpReceiver), ("http/protobuf", HttpOtlpReceiver))
MESSAGE = "quota exceeded for tenant t1"


def test_push_counts_spans_a_backend_rejected_in_a_success(tmp_path: Path) -> None:
    holds = ("push to a receiver answering success with every span rejected (HTTP, gRPC): exit 1, one error line "
             "with the count and the backend's message; an accepting receiver: exit 0")
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(10))
        p.shutdown()
    write_run(tmp_path, procs)
    with reported("OTLP partial_success: push", holds, 2 * len(PROTOCOLS)):
        for protocol, receiver in PROTOCOLS:
            with receiver() as rx:
                args = ["push", str(tmp_path), "--endpoint", rx.endpoint, "--protocol", protocol, "--timeout", "20",
                        "--batch-spans", "25"]
                accepted = CliRunner().invoke(app, args)
                assert accepted.exit_code == 0, (protocol, accepted.output)
                sent = len(rx.spans())
                assert sent > 25  # several requests
                rx.reject = MESSAGE
                res = CliRunner().invoke(app, args)
                errors = [line for line in res.output.splitlines() if line.startswith("error:")]
                assert res.exit_code == 1 and len(errors) == 1, (protocol, res.output)
                assert f"rejected {sent} of {sent} spans" in errors[0] and MESSAGE in errors[0], errors
                assert len(rx.spans()) == 2 * sent


CHILD = textwrap.dedent(
    """
    import json, os, sys
    import otel_train as ot
    for endpoint, protocol, save_path in json.loads(sys.argv[1]):
        os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                          OTEL_BSP_SCHEDULE_DELAY="20", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="16")
        ot.init(save_path=save_path, enabled=True, traces_exporter="jsonl,otlp", watchdog=False)
        for i in range(%d):
            with ot.log_trace_span("forward", i=i):
                pass
        ot.shutdown(timeout_s=30.0)
    """
)
SPANS = 40


def test_the_runtime_counts_rejected_spans_as_dropped(tmp_path: Path) -> None:
    holds = (f"{SPANS} spans exported by the runtime to a receiver that answers success and rejects them all (HTTP, "
             "gRPC): process_end's spans_dropped and the otel_train.spans_dropped instant count all of them")
    with reported("OTLP partial_success: runtime exporter", holds, len(PROTOCOLS)):
        receivers = [(protocol, receiver()) for protocol, receiver in PROTOCOLS]
        try:
            runs = []
            for protocol, rx in receivers:
                rx.start()
                rx.reject = MESSAGE
                runs.append((rx.endpoint, protocol, str(tmp_path / protocol.replace("/", "-"))))
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            done = subprocess.run([sys.executable, "-c", CHILD % SPANS, json.dumps(runs)], capture_output=True,
                                  text=True, env=env, timeout=180)
            assert done.returncode == 0, done.stderr[-3000:]
            for (protocol, rx), (_, _, save_path) in zip(receivers, runs):
                assert len(rx.spans()) >= SPANS, protocol  # delivered, then rejected by the backend
                (trace,) = traces(Path(save_path))
                dropped = [r for r in trace.records if r[S.NAME] == S.INSTANT_SPANS_DROPPED]
                assert dropped and dropped[0][S.ATTRS]["count"] >= SPANS, (protocol, dropped)
                assert trace.records[-1][S.ATTRS]["spans_dropped"] >= SPANS, protocol
            assert "partial_success" in done.stderr and MESSAGE in done.stderr, done.stderr[-2000:]
        finally:
            for _, rx in receivers:
                rx.stop()
