"""``summarize --fast``: where every rank stopped, from each file's tail, in time independent of file size.

A hang's culprit needs only where each rank stopped: its last step, its last event and the spans it
was inside. Each process file is read from its end, backwards, in windows that grow (64 KiB, then
4× at a time) until the window is known to hold all of that (:func:`_complete`); rotated segments
are read only when the active one is shorter than the window. The window's records feed a
:class:`~otel_train.analysis.spans.ProcessState` like any other batch, and the findings come from
the same rules a full summarize uses, so ``processes``, ``unclosed`` and the ``hang``/``crash``/
``restart`` findings are the same. ``phases`` come from the per-process digests the runtime writes
beside its files (approximate: each row says ``"approx": true``), or are ``null`` without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from otel_train.analysis.findings import CRASH, HANG, RESTART, findings
from otel_train.analysis.records import AnyRecord, BadLines, Head, ProcessFiles, SpanEnd, Warn, read_tail
from otel_train.analysis.spans import ProcessState, Run, process_order
from otel_train.analysis.summary import process_row, unclosed_rows

FIRST_WINDOW = 64 << 10
"""Bytes read from the end of a process's files first (about 150 records)."""
FAST_KINDS = (HANG, CRASH, RESTART)
"""The findings ``--fast`` answers; errors and stragglers need every step."""


def summarize_fast(path: str | Path, *, warn: Warn | None = None) -> dict[str, Any]:
    """The ``summarize --json`` keys from each file's tail (docs/cli.md); raises TraceReadError."""
    bad = BadLines(warn)
    states = [tail_state(pf, attempt, meta, bad) for pf, attempt, meta in process_order(path, warn=bad.warn)]
    states = [s for s in states if s.records]
    states.sort(key=lambda s: (s.rank, s.attempt, s.source))
    run = Run(states, bad.count)
    return {
        "processes": [{**process_row(d), "records": None} for d in run.processes],  # unknown from a tail
        "unclosed": [row for d in run.processes for row in unclosed_rows(d)],
        "phases": None,
        "findings": [f for f in findings(run) if f["kind"] in FAST_KINDS],
        "malformed_lines": run.malformed_lines,
        "fast": True,
    }


def tail_state(pf: ProcessFiles, attempt: int, meta: Head | None, bad: BadLines) -> ProcessState:
    """A process's state from the smallest tail window that shows where it stopped."""
    size = FIRST_WINDOW
    while True:
        # A window is read again when it grows: only the last one's bad lines are counted and reported.
        warnings: list[str] = []
        window_bad = BadLines(warnings.append)
        records, whole = read_tail(pf, size, window_bad)
        state = ProcessState.of(pf, attempt, meta=meta)
        state.feed(records)
        if whole or _complete(state, records):
            break
        size *= 4
    bad.count += window_bad.count
    for line in warnings:
        bad.warn(line)
    state.malformed = window_bad.count
    state.first_step = meta.step if meta is not None else None  # restarts report where they began
    return state


def _complete(state: ProcessState, records: list[AnyRecord]) -> bool:
    """Whether a window (not the whole file) shows the last step from its start and every open span."""
    steps = [r.step for r in records if r.step is not None]
    if not steps or min(steps) >= (state.final_step or 0):
        return False  # the window must begin before the last step did
    ended = {r.span_id for r in records if type(r) is SpanEnd}
    opened = state.opened
    for rec in opened.values():
        parent = rec.parent_span_id
        if parent is not None and parent not in opened and parent not in ended:
            return False  # its parent began before the window and is still open
    return True
