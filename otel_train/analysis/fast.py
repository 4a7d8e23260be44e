"""``summarize --fast``: where every rank stopped, from each file's tail, in time independent of file size.

A hang's culprit needs only where each rank stopped: its last step, its last event and the spans it
was inside. Each process file is read from its end, backwards, in windows that grow (64 KiB, then
4× at a time) until the window is known to hold all of that (:func:`_complete`), but never past 1/256
of the process's bytes: then the process is read whole, streamed like a full read (a step-less file, a
tail of malformed lines or of one huge line), so ``--fast`` never costs more than that. Rotated
segments are read only when the active one is shorter than the window. The window's records feed a
:class:`~otel_train.analysis.spans.ProcessState` like any other batch, and the findings come from
the same rules a full summarize uses, so ``processes``, ``unclosed`` and the ``hang``/``crash``/
``restart`` findings are the same.

The per-process digest the runtime keeps beside its file (docs/schema.md, "Digests") adds what a
tail cannot show: a span that began long before the tail and is still open (its open spans, with the
file size when it was taken: the bytes written since are scanned, not decoded, for their ends), and
the ``phases`` (merged duration sketches: approximate, each row says
``"approx": true``). Without digests ``phases`` is ``null``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from otel_train import sketch
from otel_train.analysis.findings import CLOCK_SKEW, CRASH, DESYNC, HANG, RESTART, findings
from otel_train.analysis.records import (
    AnyRecord,
    BadLines,
    Digest,
    DigestSpan,
    Head,
    ProcessFiles,
    Reader,
    SpanEnd,
    SpanStart,
    Warn,
    ended_since,
    peek,
    read_digest,
    read_tail,
)
from otel_train.analysis.spans import ProcessState, Run, process_order, read_process
from otel_train.analysis.summary import clock_rows, default_fr, process_row, unclosed_rows, with_dumps

FIRST_WINDOW = 64 << 10
"""Bytes read from the end of a process's files first (about 150 records)."""
WINDOW_SHARE_SHIFT = 8
"""Tail windows grow up to 1/256 of the process's bytes (``total >> 8``: 4 MiB of a 1 GiB file, some
10,000 records); past that the process is read whole, streamed (:func:`_whole`), so the windows read
before cost at most about 0.5 % of that read."""
MIN_LAST_WINDOW = 256 << 10
"""Windows up to this size are read whatever the file's size (a small file's tail is cheap either way)."""
FAST_KINDS = (HANG, CRASH, RESTART, DESYNC, CLOCK_SKEW)
"""The findings ``--fast`` answers (a desync when its seq is in the tails); errors and stragglers need every step."""
HEAD_RECORDS = 2000
"""Records read from the head of a process's oldest segment (within its first 64 KiB) for the
``comm.group`` and ``otel_train.mesh`` instants: group membership, declared before the first op."""


def summarize_fast(path: str | Path, *, warn: Warn | None = None, fr: str | Path | None = None,
                   align: bool = True) -> dict[str, Any]:
    """The ``summarize --json`` keys from each file's tail and digest (docs/cli.md), with the Flight
    Recorder dumps under ``fr`` (default: the run's) merged; ``align``: estimate the hosts' clocks from
    the collectives in the tails (docs/clock.md); raises TraceReadError."""
    bad = BadLines(warn)
    read = []
    for pf, attempt, meta in process_order(path, warn=bad.warn):
        digest = read_digest(pf, bad.warn)
        read.append((tail_state(pf, attempt, meta, bad, digest), digest))
    read = [(s, d) for s, d in read if s.records]
    read.sort(key=lambda sd: (sd[0].rank, sd[0].attempt, sd[0].source))
    run = with_dumps(Run([s for s, _ in read], bad.count), fr if fr is not None else default_fr(path, Run([s for s, _ in read])),
                     warn)
    run.align, run.graphs = align, None
    return {
        "processes": [{**process_row(d), "records": None} for d in run.processes],  # unknown from a tail
        "unclosed": [row for d in run.processes for row in unclosed_rows(d)],
        "phases": digest_phases(run, [d for _, d in read]),
        "findings": [f for f in findings(run, stragglers=False) if f["kind"] in FAST_KINDS],
        "clock": clock_rows(run),
        "goodput": None,  # needs every step
        "malformed_lines": run.malformed_lines,
        "fast": True,
        "digests": sum(d is not None for _, d in read),
    }


def tail_state(pf: ProcessFiles, attempt: int, meta: Head | None, bad: BadLines,
               digest: Digest | None = None) -> ProcessState:
    """A process's state from the smallest tail window that shows where it stopped (and, with its
    digest, every span still open however long ago it began)."""
    size = FIRST_WINDOW
    held = {span.span_id for span in digest.open} if digest is not None else set()
    total = pf.size
    while True:
        if size > max(MIN_LAST_WINDOW, total >> WINDOW_SHARE_SHIFT):
            state = records = None  # type: ignore[assignment]  # the last window goes before the whole read
            return _whole(pf, attempt, meta, bad)
        state, records, whole, window_bad = _window(pf, attempt, meta, size)
        if whole or _complete(state, records, held):
            break
        size *= 4
    if digest is not None and not whole:
        for span in _still_open(pf, digest, state, records):
            state.opened[span.span_id] = span.start_record()
    if not whole:
        state.layout(peek(pf, limit=HEAD_RECORDS))  # comm groups and mesh, declared at the head
    bad.absorb(window_bad)
    state.malformed = window_bad.count
    state.first_step = meta.step if meta is not None else None  # restarts report where they began
    return state


def _whole(pf: ProcessFiles, attempt: int, meta: Head | None, bad: BadLines) -> ProcessState:
    """A process whose tail windows never showed where it stopped (no step set, a tail of bad lines or
    of one huge line): read whole, streamed like a full summarize reads it (never more than that costs)."""
    reader = Reader(warn=bad.warn)
    state = read_process(pf, attempt, reader, meta=meta)
    bad.count += reader.malformed_lines
    state.first_step = meta.step if meta is not None else state.first_step
    return state


def _window(pf: ProcessFiles, attempt: int, meta: Head | None, size: int
            ) -> tuple[ProcessState, list[AnyRecord], bool, BadLines]:
    # A window is read again when it grows: only the last one's bad lines are counted and reported.
    window_bad = BadLines(collect=True)
    records, whole = read_tail(pf, size, window_bad)
    state = ProcessState.of(pf, attempt, meta=meta)
    state.feed(records)
    state.finish()  # (keep=False: only how a torchtitan/pimm file without an end record ended)
    return state, records, whole, window_bad


def _complete(state: ProcessState, records: list[AnyRecord], held: set[str]) -> bool:
    """Whether a window (not the whole file) shows the last step from its start and every open span
    (or the digest holds the open span's parent: ``held``)."""
    steps = [r.step for r in records if r.step is not None]
    if not steps or min(steps) >= (state.final_step or 0):
        return False  # the window must begin before the last step did
    ended = {r.span_id for r in records if type(r) is SpanEnd}
    opened = state.opened
    for rec in opened.values():
        parent = rec.parent_span_id
        if parent is not None and parent not in opened and parent not in ended and parent not in held:
            return False  # its parent began before the window and is still open
    return True


def _still_open(pf: ProcessFiles, digest: Digest, state: ProcessState, records: list[AnyRecord]) -> list[DigestSpan]:
    """The digest's open spans that the window neither saw begin nor end and that are open still.

    Most are settled by the window itself: a span named as a parent in it was open then and did not end
    in it; one a later span on its thread outnested has ended (:func:`_outnested`). The rest are looked
    for in the bytes written since the digest (:func:`~otel_train.analysis.records.ended_since`).
    """
    seen = set(state.opened) | {r.span_id for r in records if type(r) is SpanEnd}
    missing = {span.span_id: span for span in digest.open if span.span_id not in seen}
    parents = {r.parent_span_id for r in records}
    open_now = [span for sid, span in missing.items() if sid in parents]
    unsure = [span for sid, span in missing.items() if sid not in parents and sid not in _outnested(digest, records)]
    if unsure:
        ended = ended_since(pf, digest.file.ino, digest.file.size, [span.span_id for span in unsure])
        open_now += [span for span in unsure if ended is not None and span.span_id not in ended]
    return open_now


def _outnested(digest: Digest, records: list[AnyRecord]) -> set[str]:
    """Digest-open spans that have ended because a span began on their thread after the digest outside them.

    Spans on one thread nest (each is a context manager), so a span that starts after the digest under
    ancestor A (or as a root) means every span the digest held open on that thread below A has ended.
    """
    later = {r.span_id: r for r in records if type(r) is SpanStart and r.ts > digest.ts}
    held: dict[int | None, dict[str, DigestSpan]] = {}
    for span in digest.open:
        held.setdefault(span.tid, {})[span.span_id] = span
    closed: set[str] = set()
    for rec in later.values():
        stack = held.get(rec.tid)
        anchor = rec.parent_span_id
        while anchor in later:
            anchor = later[anchor].parent_span_id  # type: ignore[index]
        if not stack or (anchor is not None and anchor not in stack):
            continue  # its ancestry leaves the thread's stack: nothing follows
        kept = set()
        while anchor is not None and anchor in stack:
            kept.add(anchor)
            anchor = stack[anchor].parent_span_id
        closed |= stack.keys() - kept
    return closed


def digest_phases(run: Run, digests: list[Digest | None]) -> list[dict[str, Any]] | None:
    """``phases`` rows from the processes' digests merged (``approx``: ±1 % quantiles); None without any."""
    have = [(state, d) for state, d in zip(run.processes, digests) if d is not None and d.gamma == sketch.GAMMA]
    if not have:
        return None
    names = {name for _, d in have for name in d.phases}
    rows = []
    for name in [n for n in run.phase_order() if n in names] + sorted(names - set(run.phase_order())):
        parts = [(state, d.phases[name]) for state, d in have if name in d.phases]
        count = sum(p.count for _, p in parts)
        if not count:
            continue
        merged = sorted(sketch.merge(p.buckets for _, p in parts).items())
        p50, p95 = (sketch.mid_ns(sketch.quantile_index(merged, q)[1]) / 1e6 for q in (0.5, 0.95))  # type: ignore[arg-type]
        who, top = max(parts, key=lambda sp: sp[1].max_ms)
        rows.append({
            "name": name, "count": count, "mean_ms": sum(p.sum_ms for _, p in parts) / count,
            "p50_ms": p50, "p95_ms": p95, "max_ms": top.max_ms,
            "slowest": {"rank": who.rank, "attempt": who.attempt, "step": None, "dur_ms": top.max_ms},
            "approx": True,
        })
    return rows
