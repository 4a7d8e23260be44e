"""Lay one process's spans out on tracks that trace viewers can draw.

Perfetto and chrome://tracing draw a track as a stack: two slices on it must either be disjoint or
one must contain the other, or the viewer drops or spills them. Spans of one task nest naturally,
but concurrent tasks (threads, asyncio tasks) overlap without nesting, so they need tracks of their
own. ``assign_tracks`` is a greedy sweep in start order: a span joins its parent's track when the
parent is the innermost open slice there (same thread, and the parent contains it), else the first
idle track of its thread, else a new track. Sequential tasks therefore reuse tracks.

``layout_process`` turns a ``ProcessState`` into what both writers (Chrome JSON, Perfetto protobuf)
emit: display names, effective span ends (unclosed spans run to the process's last timestamp) and
the track of every span and instant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from otel_train import schema
from otel_train.analysis.spans import ProcessState, Span

DEFAULT_SOURCE = "training"


@dataclass(slots=True)
class Track:
    """One drawable track: a thread's slices, or one of its concurrent tasks."""

    index: int
    tid: int | None
    name: str = ""
    # End times and span ids of the slices open at the sweep position, outermost first.
    _ends: list[float] = field(default_factory=list)
    _ids: list[str] = field(default_factory=list)

    def settle(self, start: float) -> None:
        """Close the slices that ended at or before ``start``."""
        ends, ids = self._ends, self._ids
        while ends and ends[-1] <= start:
            ends.pop()
            ids.pop()


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What an export wrote: counts of events by kind, and where."""

    slices: int
    instants: int
    counters: int
    processes: int
    output: Path
    malformed_lines: int = 0


def assign_tracks(spans: Sequence[Span], ends: Sequence[float]) -> tuple[list[int], list[Track]]:
    """Track index of every span (``ends[i]`` is span i's effective end), and the tracks made.

    ``spans`` must be in start order. Every track is strictly nested: any two of its spans are
    disjoint or one contains the other.
    """
    tracks: list[Track] = []
    by_tid: dict[int | None, list[Track]] = {}
    track_of: dict[str, int] = {}
    out: list[int] = []
    # One pass, inlined: this runs once per span of the run.
    for span, end in zip(spans, ends):
        start, tid, parent, track = span.start_ts, span.tid, span.parent_span_id, None
        index = track_of.get(parent) if parent else None
        if index is not None:
            # The parent's track, when it is the same thread's, the parent is the innermost open
            # slice there, and the parent contains the span (an async child may outlive its parent).
            candidate = tracks[index]
            if candidate.tid == tid:
                candidate.settle(start)
                ids = candidate._ids
                if ids and ids[-1] == parent and end <= candidate._ends[-1]:
                    track = candidate
        if track is None:  # the first track of this thread with no slice open at ``start``
            for candidate in by_tid.get(tid, ()):
                candidate.settle(start)
                if not candidate._ends:
                    track = candidate
                    break
        if track is None:
            track = Track(index=len(tracks), tid=tid)
            tracks.append(track)
            by_tid.setdefault(tid, []).append(track)
        track._ends.append(end)
        track._ids.append(span.span_id)
        track_of[span.span_id] = track.index
        out.append(track.index)
    _name_tracks(tracks)
    return out, tracks


def _name_tracks(tracks: list[Track]) -> None:
    per_tid: dict[int | None, int] = {}
    for track in tracks:
        k = per_tid[track.tid] = per_tid.get(track.tid, 0) + 1
        base = "main" if track.tid is None else f"thread {track.tid}"
        track.name = base if k == 1 else f"{base} · task {k}"


@dataclass(slots=True)
class ProcessLayout:
    """A process ready to write: names, tracks, and per-span effective ends and track indices."""

    trace: ProcessState
    index: int  # 0-based position in the export; the synthetic pid is index + 1
    name: str
    labels: str
    tracks: list[Track]
    ends: list[float]
    span_tracks: list[int]
    instant_tracks: list[int]

    @property
    def pid(self) -> int:
        """Synthetic pid: real pids collide across hosts and containers."""
        return self.index + 1


def process_name(trace: ProcessState) -> str:
    """``rank 3``, ``rank 3 (attempt 1)``; the source is added when it is not the default one."""
    name = f"rank {trace.rank}"
    if trace.source != DEFAULT_SOURCE:
        name = f"{trace.source} {name}"
    if trace.attempt:
        name += f" (attempt {trace.attempt})"
    return name


def process_labels(trace: ProcessState) -> str:
    """Host and real pid, shown next to the process name."""
    parts = []
    if trace.host:
        parts.append(str(trace.host))
    if trace.pid is not None:
        parts.append(f"pid {trace.pid}")
    return ", ".join(parts)


def layout_process(trace: ProcessState, index: int) -> ProcessLayout:
    """Effective ends, track assignment for spans and instants, and display names of one process."""
    spans = trace.spans
    if any(spans[i].start_ts > spans[i + 1].start_ts for i in range(len(spans) - 1)):
        spans = trace.spans = sorted(spans, key=lambda s: s.start_ts)
    last = trace.last_ts
    # Unclosed spans run to the last timestamp; a clock step backwards never gives a negative length.
    ends = [max(s.start_ts, s.end_ts if s.end_ts is not None else last) for s in spans]
    span_tracks, tracks = assign_tracks(spans, ends)
    instant_tracks = _instant_tracks(trace, spans, span_tracks, tracks)
    return ProcessLayout(
        trace=trace,
        index=index,
        name=process_name(trace),
        labels=process_labels(trace),
        tracks=tracks,
        ends=ends,
        span_tracks=span_tracks,
        instant_tracks=instant_tracks,
    )


def _instant_tracks(
    trace: ProcessState, spans: list[Span], span_tracks: list[int], tracks: list[Track]
) -> list[int]:
    """An instant goes on its enclosing span's track, else its thread's first track, else track 0."""
    if not trace.instants:
        return []
    by_span = {s.span_id: t for s, t in zip(spans, span_tracks)}
    first_of_tid: dict[int | None, int] = {}
    for track in tracks:
        first_of_tid.setdefault(track.tid, track.index)
    out = []
    for rec in trace.instants:
        index = by_span.get(rec.span_id or "")
        if index is None:
            tid = rec.tid
            index = first_of_tid.get(tid)
            if index is None:
                index = len(tracks)
                tracks.append(Track(index=index, tid=tid))
                first_of_tid[tid] = index
                _name_tracks(tracks)
        out.append(index)
    return out


def is_incomplete(span: Span) -> bool:
    """Unclosed when the process stopped: no end record, or ended as incomplete by shutdown."""
    return span.end_ts is None or span.status == schema.STATUS_INCOMPLETE
