"""``otel-train push PATH``: send a run's spans to an OTLP endpoint, or tail a live run (``--follow``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

from otel_train.cli._app import app
from otel_train.cli._common import RUN_ID_HELP, byte_progress, cli_errors, fail, note_malformed, select_run, warn

DEFAULT_BATCH_SPANS = 512  # otel_train.analysis.push.DEFAULT_BATCH_SPANS, without importing the SDK at startup


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM end ``--follow`` cleanly: open spans are sent as incomplete before exiting."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@app.command()
def push(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="OTLP endpoint, e.g. http://127.0.0.1:4317 (grpc) or http://127.0.0.1:4318 "
        "(http/protobuf; /v1/traces is appended). Default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / "
        "OTEL_EXPORTER_OTLP_ENDPOINT, as the OTel SDK reads them."),
    protocol: Optional[str] = typer.Option(
        None, "--protocol", help="grpc or http/protobuf. Default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else grpc."),
    header: List[str] = typer.Option(
        [], "--header", help="Request header KEY=VALUE (repeatable), added to OTEL_EXPORTER_OTLP_HEADERS. "
        "Never printed."),
    service_name: Optional[str] = typer.Option(
        None, "--service-name", help="service.name of the pushed spans. Default: OTEL_SERVICE_NAME / "
        "OTEL_RESOURCE_ATTRIBUTES, else otel-train."),
    batch_spans: int = typer.Option(DEFAULT_BATCH_SPANS, "--batch-spans", min=1, help="Spans per request."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    timeout_s: Optional[float] = typer.Option(
        None, "--timeout", min=0.1, help="Seconds one request may take, the SDK's retries included. "
        "Default: OTEL_EXPORTER_OTLP_TIMEOUT, else 10."),
    follow_: bool = typer.Option(False, "--follow", help="Tail the live run and send spans as they end."),
    idle_exit: Optional[float] = typer.Option(
        None, "--idle-exit", min=0.0, help="With --follow: exit after this many seconds without new records "
        "(default: run until interrupted)."),
    poll: float = typer.Option(0.5, "--poll", min=0.05, help="With --follow: seconds between file checks."),
) -> None:
    """Send a run's spans (closed, incomplete and open ones, original ids) through the OTel SDK's OTLP exporter.

    Resources come from the records (rank, host, pid, run id, ...) on top of OTEL_RESOURCE_ATTRIBUTES.
    Instants become span events of their enclosing span; scalars are skipped. Re-running sends the same
    ids again: backends that key spans by id keep one copy. Exit codes: 0 every span accepted, 2 no trace
    files, 1 any other failure (one line naming the endpoint), spans the endpoint rejected in a successful
    answer (OTLP partial_success) included.
    """
    with cli_errors():
        select_run(run_id)
        from otel_train.analysis.records import Reader, TraceReadError  # here: start-up stays small

        if idle_exit is not None and not follow_:
            fail("--idle-exit only applies with --follow")
        if follow_ and not path.is_dir():
            raise TraceReadError(f"{path}: no such directory; pass a run directory or its structured_logs/")
        # gRPC's C core logs connection and TLS failures straight to stderr; the one error line says it.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        from otel_train.analysis import push as pushing  # the SDK and protobuf stack: only for this command
        from otel_train.analysis.otlp_send import PushError, open_destination, parse_headers

        try:
            destination = open_destination(endpoint, protocol, parse_headers(header), timeout_s)
        except PushError as exc:
            fail(str(exc))
        for message in destination.warnings:
            warn(f"warning: {message}")
        try:
            if follow_:
                with _stop_on_signals() as stop:
                    warn(f"following {path} -> {destination.shown} (Ctrl-C to stop)")
                    stats = pushing.follow(path, destination, service_name=service_name, batch_spans=batch_spans,
                                           poll_s=poll, idle_exit_s=idle_exit, stop=stop, warn=warn)
            else:
                with byte_progress(path, "pushing") as progress:
                    reader = Reader(warn=warn, progress=progress)
                    stats = pushing.replay(path, destination, service_name=service_name, batch_spans=batch_spans,
                                           reader=reader)
        except PushError as exc:
            fail(str(exc))
        finally:
            destination.close()
        typer.echo(f"pushed {stats.summary()} to {destination.shown}")
        note_malformed(stats.malformed_lines)
        rejection = stats.rejection(destination.shown)
        if rejection is not None:
            fail(rejection)  # a success that stored nothing is not a success: exit 1
