"""``otel-train push``: replay a run's trace files to an OTLP endpoint, or tail a live run (``--follow``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import typer

from otel_train.analysis.otlp_replay import (
    DEFAULT_BATCH_SPANS,
    DEFAULT_SERVICE_NAME,
    PROTOCOLS,
    PushError,
    ReplayStats,
    Sender,
    follow,
    make_sender,
    parse_headers,
    replay,
)
from otel_train.analysis.records import Reader, TraceReadError, find_process_files
from otel_train.cli._app import app


@contextmanager
def _progress(total_processes: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A span counter on stderr while pushing; only on a terminal, so logs and pipes stay clean."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed} spans"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"pushing {total_processes} processes", total=None)
        yield lambda n: progress.advance(task, n)


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


def _fail(message: str) -> typer.Exit:
    typer.echo(f"otel-train push: {message}", err=True)
    return typer.Exit(2)


@app.command()
def push(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory."),
    endpoint: str = typer.Option(..., "--endpoint", help="OTLP endpoint, e.g. http://127.0.0.1:4317 (grpc) "
                                 "or http://127.0.0.1:4318 (http/protobuf; /v1/traces is appended)."),
    protocol: str = typer.Option("grpc", "--protocol", help=f"One of: {', '.join(PROTOCOLS)}."),
    header: List[str] = typer.Option([], "--header", help="Request header KEY=VALUE (repeatable); defaults to "
                                     "OTEL_EXPORTER_OTLP_HEADERS. Never printed."),
    service_name: str = typer.Option(DEFAULT_SERVICE_NAME, "--service-name", envvar="OTEL_SERVICE_NAME",
                                     help="service.name of the pushed spans."),
    batch_spans: int = typer.Option(DEFAULT_BATCH_SPANS, "--batch-spans", min=1, help="Spans per request."),
    timeout_s: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds per request attempt."),
    follow_: bool = typer.Option(False, "--follow", help="Tail the live run and send spans as they end."),
    idle_exit: Optional[float] = typer.Option(None, "--idle-exit", min=0.0, help="With --follow: exit after "
                                              "this many seconds without new records (default: run until "
                                              "interrupted)."),
    poll: float = typer.Option(0.5, "--poll", min=0.05, help="With --follow: seconds between file checks."),
) -> None:
    """Send a run's spans (closed, incomplete and open ones, original ids) to an OTLP endpoint.

    Resources are rebuilt per process from the records, plus OTEL_RESOURCE_ATTRIBUTES.

    Instants become span events on their enclosing span; scalars are skipped. Re-running sends the
    same ids again: backends that key spans by id keep one copy.
    """
    if idle_exit is not None and not follow_:
        raise _fail("--idle-exit only applies with --follow")
    try:
        headers = parse_headers(header or [os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")])
        extra = parse_headers([os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")])
        sender = make_sender(endpoint, protocol, headers, timeout_s)
    except PushError as exc:
        raise _fail(str(exc)) from None
    try:
        if follow_:
            stats = _follow(path, sender, service_name, extra, batch_spans, poll, idle_exit)
        else:
            processes = len(find_process_files(path))
            with _progress(processes, sys.stderr.isatty()) as advance:
                stats = replay(path, sender, service_name=service_name, batch_spans=batch_spans,
                               extra_resource=extra, reader=Reader(), on_spans=advance)
    except (TraceReadError, PushError) as exc:
        raise _fail(str(exc)) from None
    finally:
        sender.close()
    _report(stats, endpoint)


def _follow(path: Path, sender: Sender, service_name: str, extra: dict[str, str], batch_spans: int,
            poll: float, idle_exit: Optional[float]) -> ReplayStats:
    if not path.is_dir():
        raise TraceReadError(f"{path}: no such directory; pass a run directory or its structured_logs/")
    with _stop_on_signals() as stop:
        typer.echo(f"following {path} -> {_shown(sender.endpoint)} (Ctrl-C to stop)", err=True)
        return follow(path, sender, service_name=service_name, batch_spans=batch_spans, extra_resource=extra,
                      poll_s=poll, idle_exit_s=idle_exit, should_stop=stop.is_set)


def _shown(endpoint: str) -> str:
    """The endpoint without any ``user:password@`` part: credentials are never echoed."""
    where = urllib.parse.urlparse(endpoint)
    if not where.hostname:
        return endpoint
    return where._replace(netloc=where.hostname + (f":{where.port}" if where.port else "")).geturl()


def _report(stats: ReplayStats, endpoint: str) -> None:
    typer.echo(f"pushed {stats.summary()} to {_shown(endpoint)}")
    if stats.malformed_lines:
        typer.echo(f"skipped {stats.malformed_lines} malformed lines", err=True)
