"""An op's arrival, written before the op is handed to the backend (docs/comm.md, "Recording").

The recorder's thread turns notes into ``comm.*`` spans up to ``POLL_S`` later; a rank that dies before
then would lose its arrival at its last op, the one a diagnosis needs most. So the wrapper, on the
issuing thread, writes the span's start record at once (the JSONL processor's ``arrival``: one record,
the record path's own cost, no SDK span) under ids chosen here; the recorder later starts the OTel span
with the same ids (``adopt``), and the processor, finding the start already written, only records it
as open. A ``recv`` from any source has its peer and per-peer ``comm.seq`` only on its end record.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable

from opentelemetry.trace import get_current_span

from otel_train import schema as S
from otel_train.comm.notes import Note

Arrival = Callable[[str, dict[str, Any], int, Any, int, int, int], None]
"""``JsonlSpanProcessor.arrival(name, attrs, start_ns, parent, trace_id, span_id, tid)``."""


def span_attrs(op: str, group: str, seq: int, peer: int | None, nbytes: int, dtype: str | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {S.ATTR_COMM_GROUP: group, S.ATTR_COMM_SEQ: seq}
    if peer is not None:
        attrs[S.ATTR_COMM_PEER] = peer
    attrs[S.ATTR_COMM_BYTES] = nbytes
    if dtype is not None:
        attrs[S.ATTR_COMM_DTYPE] = dtype
    attrs[S.ATTR_COMM_CLOCK] = S.COMM_CLOCK_HOST
    return attrs


class Herald:
    """Writes a note's start record on the issuing thread (``__call__``); the recorder adopts its ids."""

    def __init__(self, arrival: Arrival, instant: Callable[[str, dict[str, Any]], None], id_generator: Any) -> None:
        self._arrival = arrival
        self._instant = instant
        self._ids = id_generator  # the runtime's: it can be asked for the next span's ids on a thread
        self._bits = random.Random(os.urandom(16)).getrandbits  # private: training code seeds `random`

    def __call__(self, note: Note) -> None:
        state = note.group
        if not state.announced:  # the group's layout comes before its first op (once per group)
            state.announced = True
            self._instant(S.INSTANT_COMM_GROUP, state.instant_attrs())
        ctx = get_current_span().get_span_context()
        parent = ctx if ctx.is_valid else None
        trace_id = ctx.trace_id if parent is not None else self._bits(128) or 1
        span_id = self._bits(64) or 1
        self._arrival(S.comm_span_name(note.op),
                      span_attrs(note.op, state.name, note.seq, note.peer, note.nbytes, note.dtype),
                      note.start_ns, parent, trace_id, span_id, note.tid)
        note.ids = (None if parent is not None else trace_id, span_id)

    def adopt(self, note: Note) -> None:
        """On the recorder's thread, right before it starts the note's span: the span gets the ids its
        start record was written with."""
        if note.ids is not None:
            trace_id, span_id = note.ids
            if trace_id is not None:  # chosen for an op without a parent: with one, the parent's is taken
                self._ids.request_trace_id(trace_id)  # (a request left unused would go to a later span)
            self._ids.request_span_id(span_id)


def make_herald(ids: Any, arrival: Arrival | None, instant: Callable[[str, dict[str, Any]], None]) -> Herald | None:
    """A herald, or None where the start cannot be written early (no JSONL file, or no id generator that
    takes requests): the recorder then writes the whole span, as before."""
    if arrival is None or not hasattr(ids, "request_span_id"):
        return None
    return Herald(arrival, instant, ids)
