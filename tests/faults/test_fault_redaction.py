"""Secrets past the redaction rules (issue 19, item 11): a URL password in an exception raised inside a
span, a ``redact`` pattern in bridged log and exception messages, Hydra's ``+key=`` / ``++key=``
overrides. None may reach the trace file or summarize's output."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from faultlib import reported
from typer.testing import CliRunner

from otel_train.cli import app

TRAIN = textwrap.dedent(
    """
    import logging, sys
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, log_bridge=True, redact=["re:hf_[A-Za-z0-9]{20,}"])
    for step in range(3):
        with ot.training_step(step):
            try:
                with ot.log_trace_span("fetch"):
                    raise ConnectionError("GET https://bot:P4SSWRD01x@hub.example/models failed")
            except ConnectionError:
                pass
            try:
                with ot.log_trace_span("login"):
                    raise PermissionError("token hf_P4SSWRD02xAbCdEfGhIjKlMnOp rejected")
            except PermissionError:
                pass
            logging.getLogger("hub").warning("using token hf_P4SSWRD03xAbCdEfGhIjKlMnOp")
            with ot.log_trace_span("note", url="s3://k:P4SSWRD06x@bucket/x"):
                ot.log_trace_instant("fetched", source="https://u:P4SSWRD07x@mirror/y")
    raise RuntimeError("crashed at https://root:P4SSWRD08x@db/z")  # uncaught: its instant, then exit
    """
)
SECRETS = [f"P4SSWRD{i:02d}x" for i in range(1, 9)]


def test_secrets_in_span_errors_logs_and_hydra_overrides(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    argv = ["+db.password=P4SSWRD04x", "++db.password=P4SSWRD05x", "trainer.max_epochs=3"]
    holds = ("no secret (a URL password and a redact pattern in span error messages, a pattern in a bridged log "
             "message, Hydra +key=/++key= overrides, URL userinfo in attributes) in the trace file or "
             "summarize's text and JSON")
    with reported("secrets in span errors, bridged logs, Hydra +/++ overrides", holds, len(SECRETS)):
        done = subprocess.run([sys.executable, "-c", TRAIN, str(run), *argv], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1 and "crashed at" in done.stderr, done.stderr[-3000:]
        text = CliRunner().invoke(app, ["summarize", str(run)])
        as_json = CliRunner().invoke(app, ["summarize", str(run), "--json"])
        written = "\n".join(p.read_text(errors="replace") for p in run.rglob("*") if p.is_file())
        assert "process_start" in written and "fetch" in written
        everything = "\n".join([text.output, as_json.output, written])
        leaked = [s for s in SECRETS if s in everything]
        assert leaked == [], leaked
        assert "trainer.max_epochs=3" in written  # an override that is no secret stays
        assert "hub.example/models failed" in written and "<redacted>" in written
        assert "crashed at" in written  # the uncaught exception's instant is there, its password not
