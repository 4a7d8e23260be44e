"""Push a run's spans to an OTLP endpoint: whole (:func:`replay`) or while it is written (:func:`follow`).

Both build on the one span model: :func:`replay` reads one process at a time
(:func:`~otel_train.analysis.spans.iter_processes`); :func:`follow` tails the files
(:class:`~otel_train.analysis.records.Tail`: appends, rotation, processes that start later) and feeds
one :class:`~otel_train.analysis.spans.ProcessState` per process, sending each span when it ends.
Spans become SDK spans (:mod:`otel_train.analysis.otlp`) and go out in batches through a
:class:`~otel_train.analysis.otlp_send.Destination` (the SDK's OTLP exporter).

Ids are the originals: pushing again sends the same spans again, which backends keyed by span id keep
once. docs/otlp.md ("Pushing trace files") describes what is sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan

from otel_train.analysis.otlp import (
    Tally,
    base_resource,
    convert,
    events_by_span,
    process_resource,
    process_spans,
    step_links,
)
from otel_train.analysis.otlp_send import Destination
from otel_train.analysis.records import AnyRecord, BadLines, ProcessFiles, Reader, Tail, Warn, head, warn_to_stderr
from otel_train.analysis.spans import ProcessState, Span, iter_processes

DEFAULT_BATCH_SPANS = 512


@dataclass(slots=True)
class PushStats(Tally):
    """What a push sent."""

    requests: int = 0
    malformed_lines: int = 0
    rejected_spans: int = 0  # answered with success, yet rejected (OTLP partial_success): not stored
    rejected_why: str = ""  # the endpoint's last message about them

    def summary(self) -> str:
        """One line for the CLI's final count."""
        skipped = f"; {self.spans_without_ids} spans without valid ids skipped" if self.spans_without_ids else ""
        rejected = f"; {self.rejected_spans} of them rejected by the endpoint" if self.rejected_spans else ""
        return (
            f"{self.spans} spans ({self.incomplete_spans} incomplete) from {self.processes} processes "
            f"in {self.requests} requests{rejected}; {self.events} instants as span events, "
            f"{self.instants_dropped} instants without an enclosing span dropped, "
            f"{self.scalars_skipped} scalars skipped (OTLP traces carry no scalars){skipped}"
        )

    def rejection(self, shown: str) -> str | None:
        """The one error line when the endpoint rejected spans (exit 1), else None."""
        if not self.rejected_spans:
            return None
        why = f": {self.rejected_why}" if self.rejected_why else ""
        return (f"{shown} rejected {self.rejected_spans} of {self.spans} spans in successful answers "
                f"(OTLP partial_success){why}; those spans were not stored")


class Batcher:
    """Sends spans ``size`` at a time through a destination, counting requests and reporting spans sent."""

    def __init__(self, destination: Destination, size: int, stats: PushStats,
                 on_spans: Callable[[int], None] | None = None) -> None:
        self.destination, self.size, self.stats, self.on_spans = destination, max(1, size), stats, on_spans
        self._spans: list[ReadableSpan] = []

    def add(self, spans: Iterable[ReadableSpan]) -> None:
        """Queue spans, sending each full batch; raises PushError."""
        for span in spans:
            self._spans.append(span)
            if len(self._spans) >= self.size:
                self.flush()

    def flush(self) -> None:
        """Send what is queued; raises PushError."""
        if not self._spans:
            return
        batch, self._spans = self._spans, []
        rejected, why = self.destination.send(batch)
        self.stats.requests += 1
        if rejected:
            self.stats.rejected_spans += min(rejected, len(batch))
            self.stats.rejected_why = why or self.stats.rejected_why
        if self.on_spans is not None:
            self.on_spans(len(batch))


def replay(
    path: str | Path,
    destination: Destination,
    *,
    service_name: str | None = None,
    batch_spans: int = DEFAULT_BATCH_SPANS,
    reader: Reader | None = None,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
    on_spans: Callable[[int], None] | None = None,
) -> PushStats:
    """Send every span of the run at ``path`` (closed, incomplete and open ones); raises TraceReadError, PushError."""
    reader = reader if reader is not None else Reader()
    stats = PushStats()
    base = base_resource(service_name)
    batcher = Batcher(destination, batch_spans, stats, on_spans)
    for state in iter_processes(path, reader, ranks=ranks, steps=steps):
        batcher.add(process_spans(state, process_resource(state, base), stats))
        stats.processes += 1
    batcher.flush()
    stats.malformed_lines = reader.malformed_lines
    return stats


class FollowedProcess:
    """One process of a live run: record batches in, SDK spans out as they end (the span model pairs them).

    Instants wait with their open span and become its events when it ends; those whose span is not
    open are dropped and counted.
    """

    def __init__(self, pf: ProcessFiles, base: Resource, stats: PushStats) -> None:
        meta = head(pf)
        attempt = meta.attempt if meta is not None and meta.attempt is not None else 0
        self.state = ProcessState.of(pf, attempt, keep=True, meta=meta)
        self.resource = process_resource(self.state, base)
        self.stats = stats
        self._events: dict[str, list[Event]] = {}

    def feed(self, records: list[AnyRecord]) -> list[ReadableSpan]:
        """The spans these records ended."""
        state = self.state
        state.feed(records)
        closed, instants, scalars = state.drain()
        events_by_span(instants, self._events, self.stats)
        self.stats.scalars_skipped += len(scalars)
        out = self._convert(closed)
        for span_id in [sid for sid in self._events if sid not in state.opened]:
            self.stats.instants_dropped += len(self._events.pop(span_id))
        return out

    def close(self) -> list[ReadableSpan]:
        """The spans still open, ended at the last record and marked incomplete."""
        self.state.finish()
        spans, self.state.spans = self.state.spans, []
        out = self._convert(spans)
        self.stats.instants_dropped += sum(map(len, self._events.values()))
        self._events.clear()
        return out

    def _convert(self, spans: list[Span]) -> list[ReadableSpan]:
        return list(convert(spans, self.resource, self.state.last_ts or 0.0, self._events, self.stats,
                            step_links(self.state)))


def follow(
    path: str | Path,
    destination: Destination,
    *,
    service_name: str | None = None,
    batch_spans: int = DEFAULT_BATCH_SPANS,
    poll_s: float = 0.5,
    idle_exit_s: float | None = None,
    stop: threading.Event | None = None,
    warn: Warn | None = None,
    on_spans: Callable[[int], None] | None = None,
) -> PushStats:
    """Tail the run at ``path`` and send each span when it ends, until ``stop`` is set or ``idle_exit_s``
    pass without a new record; then the spans still open are sent as incomplete.

    If the run goes on, their real end arrives later under the same id. A path that does not exist
    yet is waited for. Raises PushError.
    """
    stats = PushStats()
    stop = stop if stop is not None else threading.Event()
    tail = Tail(Path(path), BadLines(warn or warn_to_stderr))
    base = base_resource(service_name)
    live: dict[tuple[str, int, str], FollowedProcess] = {}
    batcher = Batcher(destination, batch_spans, stats, on_spans)
    last_activity = time.monotonic()
    while True:
        polled = tail.poll()
        for pf, records in polled:
            proc = live.get(pf.key)
            if proc is None:
                proc = live[pf.key] = FollowedProcess(pf, base, stats)
                stats.processes += 1
            batcher.add(proc.feed(records))
        batcher.flush()
        stats.malformed_lines = tail.malformed_lines
        if polled:
            last_activity = time.monotonic()
        idle = idle_exit_s is not None and time.monotonic() - last_activity >= idle_exit_s
        if idle or stop.is_set() or stop.wait(poll_s):
            break
    for proc in live.values():
        batcher.add(proc.close())
    batcher.flush()
    return stats
