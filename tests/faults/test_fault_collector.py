"""A collector that refuses connections and one that accepts and never answers (gRPC and HTTP):
shutdown returns within its bound, the process exits right after, every undelivered span is counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from faultlib import reported, traces
from otlp_receivers import BlackHoleServer, refused_endpoint

from otel_train import schema as S

SPANS = 200
BOUND_S = 1.0
EXIT_BOUND_S = 4.0
"""How soon after its last line the child must be gone. An exporter thread that held the exit would hold
it until its export in flight gives up (the OTLP exporters' own 10 s timeout): 9.0 s, measured with the
export thread made non-daemon. The interpreter's own teardown took 1.0 s beside a busy loop, over the
1.0 s bound this had before (fresh-clone run 99)."""
CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import otel_train as ot
    for label, endpoint, protocol, save_path in json.loads(sys.argv[1]):
        os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                          OTEL_BSP_SCHEDULE_DELAY="20")
        ot.init(save_path=save_path, enabled=True, traces_exporter="jsonl,otlp", watchdog=False)
        for i in range(%d):
            with ot.log_trace_span("forward", i=i):
                pass
        time.sleep(0.3)  # an export is in flight: connecting, or waiting for an answer that never comes
        t0 = time.monotonic()
        ot.shutdown(timeout_s=%r)
        print(json.dumps({"label": label, "shutdown_s": time.monotonic() - t0}), flush=True)
    print(json.dumps({"done": time.time()}), flush=True)  # then the interpreter exits: daemon threads must not hold it
    """
) % (SPANS, BOUND_S)


def test_unreachable_collectors_never_hold_up_exit(tmp_path: Path) -> None:
    holds = (f"shutdown(timeout_s={BOUND_S}) returns within its bound; the process exits right after; "
             f"all {SPANS} spans counted in otel_train.spans_dropped and process_end; the JSONL file has them all")
    with reported("OTLP collector refusing / accepting and never answering (gRPC, HTTP)", holds, 4), \
            BlackHoleServer() as hole:
        runs = [(f"{kind} {protocol}", endpoint, protocol, str(tmp_path / f"{kind}-{protocol.replace('/', '-')}"))
                for kind, endpoint in (("refused", refused_endpoint()), ("black hole", hole.endpoint))
                for protocol in ("grpc", "http/protobuf")]
        t0 = time.monotonic()
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(runs)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        out, err = child.communicate(timeout=120)
        exited = time.time()
        lines = out.splitlines()
        assert child.returncode == 0 and lines and "done" in lines[-1], err[-3000:]
        assert exited - json.loads(lines[-1])["done"] < EXIT_BOUND_S  # no exporter thread keeps the process alive
        results = [json.loads(line) for line in lines[:-1]]
        assert [r["label"] for r in results] == [run[0] for run in runs]
        for result in results:
            assert result["shutdown_s"] < BOUND_S + 0.25, result
        assert time.monotonic() - t0 < 60
        assert "Traceback" not in err, err[-3000:]
        for label, _, _, save_path in runs:
            (trace,) = traces(Path(save_path))
            assert not trace.torn
            ends = [r for r in trace.records if r[S.KIND] == S.SPAN_END]
            assert len(ends) == SPANS, label
            dropped = [r for r in trace.records if r[S.NAME] == S.INSTANT_SPANS_DROPPED]
            assert dropped and dropped[0][S.ATTRS]["count"] == SPANS, (label, dropped)
            assert trace.records[-1][S.ATTRS]["spans_dropped"] == SPANS, label
