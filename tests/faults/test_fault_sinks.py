"""Sinks that lie or hide things: an OTLP/HTTP endpoint that answers every export with a redirect (it
stores nothing), and a second sink that used to make the JSONL file drop the user's ``training.*``
attributes.

What must hold: only a success status (2xx) counts as delivered. With a redirecting collector the
runtime counts every span in ``otel_train.spans_dropped`` / ``process_end.spans_dropped`` and warns,
and ``otel-train push`` exits 1 with one line that names the status; the JSONL file keeps every
attribute the user gave, whatever other sinks are on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from faultlib import reported, traces
from otlp_receivers import refused_endpoint

from otel_train import schema as S

SPANS = 300


class _Redirect(BaseHTTPRequestHandler):
    status = 301

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's spelling
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts += 1  # type: ignore[attr-defined]
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.send_header("Location", "http://127.0.0.1:9/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args: object) -> None:
        return None


class Redirecting:
    """An HTTP server answering every request with ``status`` (a redirect) and storing nothing."""

    def __init__(self, status: int = 301) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirect)
        self.server.posts = 0  # type: ignore[attr-defined]
        self.server.status = status  # type: ignore[attr-defined]
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Redirecting:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


CHILD = textwrap.dedent(
    """
    import sys
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, traces_exporter="jsonl,otlp", watchdog=False)
    for step in range(%d):
        with ot.training_step(step):
            pass
    ot.shutdown(timeout_s=5.0)
    """
) % SPANS


def _env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
               OTEL_BSP_SCHEDULE_DELAY="20", OTEL_EXPORTER_OTLP_TIMEOUT="2")
    return env


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirecting_collector_is_not_delivery(tmp_path: Path, status: int) -> None:
    holds = (f"the runtime counts all {SPANS} spans as dropped (otel_train.spans_dropped, process_end) and warns "
             "naming the status; push exits 1 with one line naming it, never 'pushed'")
    with reported(f"OTLP/HTTP collector answering every export with {status}", holds, 2), \
            Redirecting(status) as collector:
        run = tmp_path / "run"
        done = subprocess.run([sys.executable, "-c", CHILD, str(run)], env=_env(collector.endpoint),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert collector.server.posts >= 1  # type: ignore[attr-defined]
        (trace,) = traces(run)
        assert len([r for r in trace.records if r[S.KIND] == S.SPAN_END]) == SPANS
        dropped = [r for r in trace.records if r[S.NAME] == S.INSTANT_SPANS_DROPPED]
        assert dropped and dropped[0][S.ATTRS]["count"] == SPANS, (dropped, done.stderr[-2000:])
        assert trace.records[-1][S.ATTRS]["spans_dropped"] == SPANS
        assert str(status) in done.stderr and "redirect" in done.stderr, done.stderr[-2000:]

        pushed = subprocess.run([sys.executable, "-m", "otel_train.cli", "push", str(run), "--protocol",
                                 "http/protobuf", "--endpoint", collector.endpoint, "--timeout", "2"],
                                env=_env(refused_endpoint()), capture_output=True, text=True, timeout=120)
        assert pushed.returncode == 1, (pushed.stdout, pushed.stderr)
        assert "pushed" not in pushed.stdout, pushed.stdout
        errors = [line for line in pushed.stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and str(status) in errors[0] and "redirect" in errors[0], pushed.stderr


ATTRS_CHILD = textwrap.dedent(
    """
    import json, sys
    import otel_train as ot
    exporters = sys.argv[2]
    class Keep:
        def on_record(self, record):
            pass
    handlers = [lambda: Keep()] if sys.argv[3] == "handler" else None
    ot.init(save_path=sys.argv[1], enabled=True, traces_exporter=exporters, watchdog=False,
            **({"handlers": handlers} if handlers else {}))
    with ot.training_step(5):
        with ot.log_trace_span("forward", **{"training.micro_batch": 7, "model.layers": 12,
                                             "training.step": 99}) as span:
            span.set_attribute("training.later", "x")
    ot.shutdown(timeout_s=1.0)
    """
)
SINKS = [("jsonl", "-"), ("jsonl,console", "-"), ("jsonl,otlp", "-"), ("jsonl", "handler")]


def test_user_training_attributes_survive_a_second_sink(tmp_path: Path) -> None:
    holds = ("forward's span_end attrs hold training.micro_batch, model.layers, training.step=99 (user-given, "
             "not the context's 5) and training.later (set in the span) with JSONL alone, +console, +otlp, "
             "+a record handler; no training.* copy of the step context is added to JSONL")
    with reported("user attributes named training.* with a second sink (console, OTLP, handler)", holds,
                  len(SINKS)):
        for exporters, handler in SINKS:
            run = tmp_path / f"{exporters.replace(',', '-')}-{handler}"
            done = subprocess.run([sys.executable, "-c", ATTRS_CHILD, str(run), exporters, handler],
                                  env=_env(refused_endpoint()), capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            (trace,) = traces(run)
            end = next(r for r in trace.records if r[S.KIND] == S.SPAN_END and r[S.NAME] == "forward")
            assert end[S.ATTRS] == {"training.micro_batch": 7, "model.layers": 12, "training.step": 99,
                                    "training.later": "x"}, (exporters, handler, end[S.ATTRS])
            start = next(r for r in trace.records if r[S.KIND] == S.SPAN_START and r[S.NAME] == "forward")
            assert start[S.ATTRS] == {"training.micro_batch": 7, "model.layers": 12, "training.step": 99}
            step_end = next(r for r in trace.records if r[S.KIND] == S.SPAN_END and r[S.NAME] == "step")
            assert not any(k.startswith("training.") for k in step_end.get(S.ATTRS, {})), step_end
            assert end[S.STEP] == 5
            json.dumps(end)
