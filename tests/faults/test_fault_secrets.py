"""Planted secrets: environment variables, argv flags, OTLP headers, an endpoint with userinfo, a URL in
a log message. None may appear in anything written or printed: trace files, stdout, stderr, the
exported Perfetto/Chrome trace, summarize's JSON."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from faultlib import reported
from otlp_receivers import refused_endpoint
from typer.testing import CliRunner

from otel_train.cli import app

SECRETS = {f"S3CR3T{i:02d}x" for i in range(1, 15)}
TRAIN = textwrap.dedent(
    """
    import logging, sys
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, log_bridge=True)
    for step in range(3):
        with ot.training_step(step), ot.log_trace_span("forward", note="plain"):
            logging.getLogger("data").warning("fetching http://reader:S3CR3T12x@minio:9000/bucket")
    ot.shutdown(timeout_s=1.0)
    print("done")
    """
)


def test_planted_secrets_are_never_written_or_printed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    endpoint = refused_endpoint().replace("http://", "http://collector:S3CR3T08x@")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({
        "DB_PASS": "S3CR3T01x", "MY_API_TOKEN": "S3CR3T02x", "AWS_SECRET_ACCESS_KEY": "S3CR3T03x",
        "SESSION_COOKIE": "S3CR3T04x", "HTTPS_PROXY": "http://me:S3CR3T05x@proxy:3128", "MYSQL_PWD": "S3CR3T06x",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20S3CR3T07x,x-api-key=S3CR3T13x",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_EXPORTER": "jsonl,otlp",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "0.5", "OTEL_BSP_SCHEDULE_DELAY": "20",
        "OTEL_TRAIN_REDACT": "re:hf_[A-Za-z0-9]{20,}", "NOTE": "token hf_S3CR3T14xAbCdEfGhIjKlMn in a value",
    })
    argv = ["--api-key", "S3CR3T09x", "--password=S3CR3T10x", "--token", "S3CR3T11x", "db.password=S3CR3T01x"]
    holds = ("no planted secret (14: env by name, URL userinfo, OTLP headers and endpoint, argv flags and "
             "key=value, a redact pattern, a logged URL) in the trace files, stdout, stderr, export or summarize")
    with reported("planted secrets (env, argv, OTLP headers, endpoint userinfo, log message)", holds, len(SECRETS)):
        done = subprocess.run([sys.executable, "-c", TRAIN, str(run), *argv], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
        exported = CliRunner().invoke(app, ["export", str(run), "--output", str(tmp_path / "trace.json")])
        summary = CliRunner().invoke(app, ["summarize", str(run), "--json"])
        assert exported.exit_code == summary.exit_code == 0, (exported.output, summary.output)
        written = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()]
        assert len(written) >= 2 and any("process_start" in text for text in written)
        # The user's own log line reaches stderr as Python prints it (the bridge keeps that); ours must not.
        stderr = done.stderr.replace("fetching http://reader:S3CR3T12x@minio:9000/bucket", "")
        everything = "\n".join([done.stdout, stderr, exported.output, summary.output, *written])
        leaked = sorted(s for s in SECRETS if s in everything)
        assert leaked == [], leaked
        assert "<redacted>" in everything  # they were there, and replaced
