"""Perfetto's native trace format: a stream of ``TracePacket`` protobufs, encoded from columns.

Field numbers come from perfetto's ``trace_packet.proto``, ``track_event.proto``,
``track_descriptor.proto``, ``process_descriptor.proto``, ``thread_descriptor.proto``,
``counter_descriptor.proto``, ``interned_data.proto`` and ``debug_annotation.proto`` (the test decodes
our output with the ``perfetto`` package's own generated classes).

Each process is one trusted packet sequence (id: the synthetic pid) whose first packet interns all
its event names. Its events are in time order, and on each track a slice's end comes before the next
begin at the same timestamp (every track is strictly nested), so the trace processor never reorders
a track. Timestamps are absolute Unix nanoseconds at microsecond resolution (the UI shows them
relative to the trace start itself), so the same layout as the Chrome JSON export survives exactly.

Packets are not built one by one: :class:`Rows` lays out one packet per row as parts (a constant, a
column of varints, per-row slices of a byte buffer), and writes thousands of rows at a time through
a padded byte matrix and a mask (docs/export.md).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import IO, Any, NamedTuple

import msgspec
import numpy as np

from otel_train import schema
from otel_train.analysis.protowire import (
    UUID_STRIDE as _UUID_STRIDE, WT_I64 as _WT_I64, WT_LEN as _WT_LEN, WT_VARINT as _WT_VARINT, bytes_field,
    key as _key, process_uuid as _process_uuid, str_field, uint_field,
)
from otel_train.analysis.export.layout import (
    NO_STEP, CounterColumns, Counts, FlowColumns, InstantColumns, ProcessLayout, SpanColumns, track_tid,
)

# Trace
TRACE_PACKET = 1
# TracePacket
PKT_TIMESTAMP = 8
PKT_SEQUENCE_ID = 10
PKT_TRACK_EVENT = 11
PKT_INTERNED_DATA = 12
PKT_SEQUENCE_FLAGS = 13
PKT_TRACK_DESCRIPTOR = 60
SEQ_INCREMENTAL_STATE_CLEARED = 1
SEQ_NEEDS_INCREMENTAL_STATE = 2
# TrackDescriptor / ProcessDescriptor / ThreadDescriptor / CounterDescriptor
TD_UUID = 1
TD_NAME = 2
TD_PROCESS = 3
TD_THREAD = 4
TD_PARENT_UUID = 5
TD_COUNTER = 8
PD_PID = 1
PD_NAME = 6
THD_PID = 1
THD_TID = 2
THD_NAME = 5
# TrackEvent
TE_DEBUG_ANNOTATIONS = 4
TE_TYPE = 9
TE_NAME_IID = 10
TE_TRACK_UUID = 11
TE_DOUBLE_COUNTER_VALUE = 44
TE_FLOW_IDS = 47  # repeated fixed64: flows that start at or pass through this event
TE_TERMINATING_FLOW_IDS = 48  # repeated fixed64: flows that end at this event
TYPE_SLICE_BEGIN = 1
TYPE_SLICE_END = 2
TYPE_INSTANT = 3
TYPE_COUNTER = 4
# InternedData / EventName
ID_EVENT_NAMES = 2
EN_IID = 1
EN_NAME = 2
# DebugAnnotation
DA_BOOL = 2
DA_INT = 4
DA_DOUBLE = 5
DA_STRING = 6
DA_NAME = 10

HEAD = b""
"""A protobuf stream has no header ..."""
SEPARATOR = b""
"""... nor separators: packets simply follow each other."""

_COUNTER_UUID_BASE = 1 << 23
_INT64_MAX = (1 << 63) - 1
_CHUNK_ROWS = 4096
EVENT_CHUNK = 8192
"""Events (and spans' annotations) encoded at a time: what a process needs beyond its layout stays bounded."""
_CHUNK_BYTES = 4 << 20
"""Rows are written a chunk at a time; a chunk whose padded matrix would exceed this is halved."""
_pack_double = struct.Struct("<d").pack
_encode_json = msgspec.json.Encoder().encode


# ---------------------------------------------------------------------------------------------
# Single fields


def debug_annotation(name: str, value: object) -> bytes:
    """One named argument (a TrackEvent field); lists and dicts are kept as JSON text."""
    if type(value) is bool:
        body = uint_field(DA_BOOL, int(value))
    elif isinstance(value, int) and -_INT64_MAX - 1 <= value <= _INT64_MAX:
        body = uint_field(DA_INT, value)
    elif isinstance(value, (int, float)):
        body = _key(DA_DOUBLE, _WT_I64) + _pack_double(float(value))
    elif isinstance(value, str):
        body = str_field(DA_STRING, value)
    else:
        body = str_field(DA_STRING, _encode_json(value).decode())
    return bytes_field(TE_DEBUG_ANNOTATIONS, str_field(DA_NAME, name) + body)


# ---------------------------------------------------------------------------------------------
# Columns of fields


class _Part(NamedTuple):
    data: np.ndarray  # uint8 (rows x width): row i's bytes start at data[starts[i]] (row i when None)
    starts: np.ndarray | None
    lens: np.ndarray  # bytes on each row (0: the part is absent there)


def varints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Base-128 varints of a column: a (rows x width) uint8 block and each row's length."""
    rest = values.astype(np.uint64)  # int64 -> two's complement, as protobuf encodes it
    width = 1
    top = int(rest.max(initial=0))
    while top >> (7 * width):
        width += 1
    out = np.empty((len(rest), width), np.uint8)
    lens = np.ones(len(rest), np.int64)
    for k in range(width):
        more = rest > 0x7F
        out[:, k] = (rest & np.uint64(0x7F)) | (more.astype(np.uint64) << np.uint64(7))
        lens += more
        rest = rest >> np.uint64(7)
    return out, lens


def blobs(items: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list of byte strings as one buffer with offsets and lengths."""
    lens = np.fromiter(map(len, items), np.int64, len(items))
    starts = np.cumsum(lens) - lens
    return np.frombuffer(b"".join(items), np.uint8), starts, lens


class Rows:
    """One protobuf message per row, built part by part in field order (see the module doc)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.parts: list[_Part] = []

    def lens(self) -> np.ndarray:
        """Each row's encoded length."""
        return sum((p.lens for p in self.parts), np.zeros(self.n, np.int64))

    def const(self, data: bytes, on: np.ndarray | None = None) -> None:
        """The same bytes on every row (on the rows where ``on``)."""
        block = np.broadcast_to(np.frombuffer(data, np.uint8), (self.n, len(data)))
        lens = np.full(self.n, len(data), np.int64)
        self.parts.append(_Part(block, None, lens if on is None else lens * on))

    def field(self, field: int, values: np.ndarray, on: np.ndarray | None = None) -> None:
        """A varint field with one value per row (on the rows where ``on``)."""
        self.const(_key(field, _WT_VARINT), on)
        block, lens = varints(values)
        self.parts.append(_Part(block, None, lens if on is None else lens * on))

    def block(self, data: np.ndarray, lens: np.ndarray) -> None:
        """Row i gets ``data[i, :lens[i]]`` (``data``: rows x width bytes)."""
        self.parts.append(_Part(data, None, lens))

    def ragged(self, data: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> None:
        """Row i gets ``data[starts[i]:starts[i] + lens[i]]``."""
        width = max(int(lens.max(initial=0)), 1)
        if int(starts.max(initial=0)) + width > len(data):  # the last slices need zeros after the buffer
            data = np.concatenate([data, np.zeros(width, np.uint8)])
        # Each row's bytes are one row of a sliding window over the buffer: gathered by memcpy.
        self.parts.append(_Part(np.lib.stride_tricks.sliding_window_view(data, width), starts, lens))

    def lookup(self, items: Sequence[bytes], codes: np.ndarray) -> None:
        """Row i gets ``items[codes[i]]``; nothing where the code is -1."""
        data, starts, lens = blobs(list(items) + [b""])
        self.ragged(data, starts[codes], lens[codes])

    def message(self, field: int, inner: Rows, on: np.ndarray | None = None) -> None:
        """``inner`` as a length-delimited field (on the rows where ``on``; inner must be empty elsewhere)."""
        self.const(_key(field, _WT_LEN), on)
        block, lens = varints(inner.lens())
        self.parts.append(_Part(block, None, lens if on is None else lens * on))
        self.parts.extend(inner.parts)

    def compact(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All rows as one buffer with offsets and lengths (to nest them in other rows)."""
        lens = self.lens()
        return np.frombuffer(self.tobytes(), np.uint8), np.cumsum(lens) - lens, lens

    def tobytes(self) -> bytes:
        """All rows, concatenated."""
        out: list[bytes] = []
        for a in range(0, self.n, _CHUNK_ROWS):
            self._write(a, min(self.n, a + _CHUNK_ROWS), out)
        return b"".join(out)

    def write(self, f: IO[bytes]) -> None:
        """All rows, written to ``f`` a chunk at a time."""
        for a in range(0, self.n, _CHUNK_ROWS):
            out: list[bytes] = []
            self._write(a, min(self.n, a + _CHUNK_ROWS), out)
            f.writelines(out)

    def _write(self, a: int, b: int, out: list[bytes]) -> None:
        """Rows a..b through a padded matrix: each part in its columns, a mask keeps the real bytes."""
        lens = np.stack([p.lens[a:b] for p in self.parts])
        widths = lens.max(axis=1).tolist()
        if (b - a) * sum(widths) > _CHUNK_BYTES and b - a > 1:
            mid = (a + b) // 2
            self._write(a, mid, out)
            self._write(mid, b, out)
            return
        matrix = np.empty((b - a, sum(widths)), np.uint8)
        mask = np.empty(matrix.shape, bool)
        column = 0
        for part, width, part_lens in zip(self.parts, widths, lens):
            if not width:
                continue
            cols = slice(column, column + width)
            rows = part.data[a:b] if part.starts is None else part.data[part.starts[a:b]]
            matrix[:, cols] = rows[:, :width]
            if part_lens.min() == width:
                mask[:, cols] = True
            else:
                small = np.uint8 if width < 256 else np.int64
                mask[:, cols] = np.arange(width, dtype=small) < part_lens.astype(small)[:, None]
            column += width
        out.append(matrix[mask].tobytes())


# ---------------------------------------------------------------------------------------------
# A process


def render(lay: ProcessLayout, origin_us: int, out: IO[bytes]) -> Counts:
    """Write one laid-out process's packets to ``out``, a chunk of events at a time; its counts.
    ``origin_us`` is not needed: packets carry absolute times."""
    out.write(_descriptors(lay))
    kind, ref, ts_us = _event_order(lay)
    payloads = {BEGIN: _span_annotations(lay), INSTANT: _instant_annotations(lay), COUNTER: _counter_values(lay)}
    for a in range(0, len(kind), EVENT_CHUNK):
        b = a + EVENT_CHUNK
        n = len(kind[a:b])
        firsts = [(0, _interned_names(lay.names))] if a == 0 else []
        _packets(lay, kind[a:b], ref[a:b], ts_us[a:b], payloads, np.full(n, lay.pid), firsts).write(out)
    return _counts(lay)


def _counts(lay: ProcessLayout) -> Counts:
    return Counts(len(lay.spans.start_us), len(lay.instants.ts_us), len(lay.counters.ts_us), 1)


def _events(lay: ProcessLayout) -> int:
    return 2 * len(lay.spans.start_us) + len(lay.instants.ts_us) + len(lay.counters.ts_us)


class Batch:
    """Small processes written together: the bytes :func:`render` writes for each, in the same order,
    with one set of numpy calls per :data:`EVENT_CHUNK` events instead of a few hundred per process
    (a 10-step window of 1,024 ranks: about 50 events a process). A format without separators only.

    ``add`` keeps a process with fewer events than :data:`EVENT_CHUNK` (writing what it held first when
    the two would exceed that) and renders a larger or empty one at once; ``flush`` writes what is held.
    """

    def __init__(self, origin_us: int, out: IO[bytes]) -> None:
        self.origin_us, self.out = origin_us, out
        self.held: list[ProcessLayout] = []
        self.events = 0

    def add(self, lay: ProcessLayout) -> Counts:
        """Render ``lay`` (now or at a later flush); its counts."""
        events = _events(lay)
        if self.held and self.events + events > EVENT_CHUNK:
            self.flush()
        if not 0 < events < EVENT_CHUNK:
            return render(lay, self.origin_us, self.out)
        self.held.append(lay)
        self.events += events
        return _counts(lay)

    def flush(self) -> None:
        """Write the processes held, as :func:`render` writes them one after another."""
        if len(self.held) == 1:
            render(self.held[0], self.origin_us, self.out)
        elif self.held:
            _render_merged(self.held, self.out)
        self.held, self.events = [], 0


def _render_merged(lays: list[ProcessLayout], out: IO[bytes]) -> None:
    """Processes with events, each under :data:`EVENT_CHUNK`, as one table of events: every process's
    descriptors ride before its first packet, whose sequence starts there and interns its names."""
    merged, offsets = _merged(lays)
    orders = [_event_order(lay) for lay in lays]
    sizes = [len(kind) for kind, _, _ in orders]
    firsts = np.cumsum([0] + sizes[:-1])
    kind = np.concatenate([k for k, _, _ in orders])
    ts_us = np.concatenate([t for _, _, t in orders])
    process = np.repeat(np.arange(len(lays)), sizes)
    ref = np.concatenate([r for _, r, _ in orders]) + offsets[process, np.array([0, 0, 1, 2])[kind]]
    pid = np.array([lay.pid for lay in lays])[process]
    payloads = {BEGIN: _span_annotations(merged), INSTANT: _instant_annotations(merged),
                COUNTER: _counter_values(merged)}
    starts = [(int(f), _interned_names(lay.names)) for f, lay in zip(firsts, lays)]
    _packets(merged, kind, ref, ts_us, payloads, pid, starts, [_descriptors(lay) for lay in lays]).write(out)


def _merged(lays: list[ProcessLayout]) -> tuple[ProcessLayout, np.ndarray]:
    """The processes' spans, instants and counters as one layout's columns (codes into the joined
    tables shifted by each process's table offsets; names stay per process, as their sequences intern
    them); and per process its first span's, instant's and counter's row there."""
    spans = [lay.spans for lay in lays]
    n_spans = np.array([len(s.start_us) for s in spans])
    n_inst = np.array([len(lay.instants.ts_us) for lay in lays])
    n_ctr = np.array([len(lay.counters.ts_us) for lay in lays])
    offsets = np.stack([np.cumsum(n_spans) - n_spans, np.cumsum(n_inst) - n_inst, np.cumsum(n_ctr) - n_ctr], axis=1)
    status_at = np.cumsum([0] + [len(lay.statuses) for lay in lays[:-1]])
    attrs_at = np.cumsum([0] + [len(lay.attrs) for lay in lays[:-1]])
    cat = np.concatenate
    joined = SpanColumns(
        cat([s.start_us for s in spans]), cat([s.end_us for s in spans]), cat([s.track for s in spans]),
        cat([s.name for s in spans]), cat([s.step for s in spans]),
        cat([s.status + a for s, a in zip(spans, status_at)]),
        cat([np.where(s.attrs >= 0, s.attrs + a, -1) for s, a in zip(spans, attrs_at)]),
        cat([s.incomplete for s in spans]), cat([s.failed for s in spans]), cat([s.span_ids for s in spans]),
        {int(i + off): e for s, off in zip(spans, offsets[:, 0]) for i, e in s.errors.items()})
    instants = InstantColumns(cat([lay.instants.ts_us for lay in lays]), cat([lay.instants.track for lay in lays]),
                              cat([lay.instants.name for lay in lays]), [a for lay in lays for a in lay.instants.args])
    counters = CounterColumns(cat([lay.counters.ts_us for lay in lays]), cat([lay.counters.key for lay in lays]),
                              cat([lay.counters.values for lay in lays]), cat([lay.counters.integral for lay in lays]))
    flows = [(lay.flows, off) for lay, off in zip(lays, offsets[:, 0]) if lay.flows is not None]
    flow = FlowColumns(cat([f.span + off for f, off in flows]), *(cat([getattr(f, k) for f, _ in flows])
                       for k in ("flow", "flow_in", "flow_out", "last_arrival"))) if flows else None
    merged = ProcessLayout(lays[0].index, "", "", [], joined, instants, counters, [],
                           [x for lay in lays for x in lay.statuses], [x for lay in lays for x in lay.attrs], [], flow)
    return merged, offsets


def tail(origin_us: int, processes: int, malformed: int, clock: Any = None) -> bytes:
    """Nothing: the stream ends with the last process's packets (a moved host's offsets are in its
    process name: docs/clock.md)."""
    return b""


def _track_uuid(pid: int, track_index: int | np.ndarray) -> int | np.ndarray:
    return pid * _UUID_STRIDE + 1 + track_index


def _counter_uuid(pid: int, key: int | np.ndarray) -> int | np.ndarray:
    return pid * _UUID_STRIDE + _COUNTER_UUID_BASE + key


def _descriptor(body: bytes) -> bytes:
    return bytes_field(TRACE_PACKET, bytes_field(PKT_TRACK_DESCRIPTOR, body))


def _descriptors(lay: ProcessLayout) -> bytes:
    pid = lay.pid
    name = f"{lay.name} ({lay.labels})" if lay.labels else lay.name
    process = uint_field(PD_PID, pid) + str_field(PD_NAME, name)
    out = [_descriptor(uint_field(TD_UUID, _process_uuid(pid)) + bytes_field(TD_PROCESS, process))]
    for track in lay.tracks:
        thread = (uint_field(THD_PID, pid) + uint_field(THD_TID, track_tid(pid, track.index))
                  + str_field(THD_NAME, track.name))
        out.append(_descriptor(uint_field(TD_UUID, _track_uuid(pid, track.index)) + bytes_field(TD_THREAD, thread)))
    for code, key in enumerate(lay.counter_keys):
        out.append(_descriptor(uint_field(TD_UUID, _counter_uuid(pid, code)) + uint_field(TD_PARENT_UUID, _process_uuid(pid))
                               + str_field(TD_NAME, key) + bytes_field(TD_COUNTER, b"")))
    return b"".join(out)


def _last_descendants(track: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For each span, its last descendant in start order (itself when none): on its track, the spans
    after it that start before it ends (tracks are strictly nested)."""
    n = len(track)
    order = np.argsort(track, kind="stable")
    s, e, t = start[order], end[order], track[order]
    cuts = [0, *(np.flatnonzero(np.diff(t)) + 1).tolist(), n]
    last = np.empty(n, np.int64)
    for a, b in zip(cuts[:-1], cuts[1:]):  # one search per track
        first_after = np.searchsorted(s[a:b], e[a:b], side="left") + a
        last[a:b] = np.maximum(first_after - 1, np.arange(a, b))
    out = np.empty(n, np.int64)
    out[order] = order[last]
    return out


BEGIN, END, INSTANT, COUNTER = range(4)
"""Event rows, by kind (the TrackEvent type is kind + 1)."""


def _event_order(lay: ProcessLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind, index into its columns, Unix µs) of every event, in the order they are written: by time;
    at one time on one track, slice events in bracket order (ends of inner slices first, a slice's end
    before a later sibling's begin), then instants; counters last."""
    spans, inst, ctr = lay.spans, lay.instants, lay.counters
    n, m, c = len(spans.start_us), len(inst.ts_us), len(ctr.ts_us)
    j = np.arange(n)
    last = _last_descendants(spans.track, spans.start_us, spans.end_us)
    # A begin sorts at (j, 0, 0), an end at (last descendant, 1, inner first): one int64 key.
    bracket = np.concatenate([j * 2 * (n + 1), (last * 2 + 1) * (n + 1) + (n - j)])
    kind = np.repeat(np.array([BEGIN, END, INSTANT, COUNTER]), [n, n, m, c])
    ref = np.concatenate([j, j, np.arange(m), np.arange(c)])
    ts = np.concatenate([spans.start_us, spans.end_us, inst.ts_us, ctr.ts_us])
    klass = np.maximum(kind - 1, 0)  # slices, instants, counters
    order = np.lexsort((np.concatenate([bracket, ref[2 * n:]]), klass, ts))
    return kind[order], ref[order], ts[order]


def _span_annotations(lay: ProcessLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each span's debug annotations as bytes: one buffer, each span's offset and length."""
    n = len(lay.spans.start_us)
    chunks = [_span_annotation_rows(lay, a, min(n, a + EVENT_CHUNK)).compact() for a in range(0, n, EVENT_CHUNK)]
    if not chunks:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    offsets = np.cumsum([0] + [len(data) for data, _, _ in chunks[:-1]])
    lens = np.concatenate([lens for _, _, lens in chunks])
    # Padded once here, so that no chunk of events copies the buffer to take its longest slice.
    data = np.concatenate([*(data for data, _, _ in chunks), np.zeros(int(lens.max()), np.uint8)])
    return data, np.concatenate([starts + offset for (_, starts, _), offset in zip(chunks, offsets)]), lens


def _span_annotation_rows(lay: ProcessLayout, lo: int, hi: int) -> Rows:
    """Spans lo..hi's annotations: step, span_id, status, attributes, error, incomplete."""
    spans = lay.spans
    rows = Rows(hi - lo)
    steps = spans.step[lo:hi]
    has_step = steps != NO_STEP
    step = Rows(rows.n)
    step.const(str_field(DA_NAME, schema.STEP), has_step)
    step.field(DA_INT, steps, has_step)
    rows.message(TE_DEBUG_ANNOTATIONS, step, has_step)
    ids = spans.span_ids[lo:hi]
    span_id = Rows(rows.n)
    span_id.const(str_field(DA_NAME, schema.SPAN_ID))
    text = Rows(rows.n)
    text.block(ids.view(np.uint8).reshape(rows.n, ids.itemsize), np.char.str_len(ids).astype(np.int64))
    span_id.message(DA_STRING, text)
    rows.message(TE_DEBUG_ANNOTATIONS, span_id)
    rows.lookup([debug_annotation(schema.STATUS, s) for s in lay.statuses], spans.status[lo:hi])
    rows.lookup([b"".join(debug_annotation(str(k), v) for k, v in (a or {}).items()) for a in lay.attrs],
                spans.attrs[lo:hi])
    errors = {i - lo: e for i, e in spans.errors.items() if lo <= i < hi}
    error_code = np.full(rows.n, -1)
    error_code[list(errors)] = np.arange(len(errors))
    rows.lookup([debug_annotation(schema.ERROR, e) for e in errors.values()], error_code)
    rows.const(debug_annotation("incomplete", True), spans.incomplete[lo:hi])
    _flow_fields(lay, rows, lo, hi)
    return rows


def _flow_fields(lay: ProcessLayout, rows: Rows, lo: int, hi: int) -> None:
    """Comm spans lo..hi: ``last_arrival`` and their flow, as TrackEvent fields after the annotations (a
    flow that goes on from a span is in ``flow_ids``, one that ends there in ``terminating_flow_ids``)."""
    flows = lay.flows
    if flows is None:
        return
    inside = (flows.span >= lo) & (flows.span < hi)
    if not inside.any():
        return
    items: list[bytes] = []
    code = np.full(rows.n, -1)
    for i, flow, out_of, last in zip(flows.span[inside].tolist(), flows.flow[inside].tolist(),
                                     flows.flow_out[inside].tolist(), flows.last_arrival[inside].tolist()):
        field = TE_FLOW_IDS if out_of else TE_TERMINATING_FLOW_IDS
        extra = _key(field, _WT_I64) + struct.pack("<Q", flow) if flow else b""
        code[i - lo] = len(items)
        items.append((debug_annotation("last_arrival", True) if last else b"") + extra)
    rows.lookup(items, code)


def _instant_annotations(lay: ProcessLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return blobs([b"".join(debug_annotation(str(k), v) for k, v in args.items()) for args in lay.instants.args])


def _counter_values(lay: ProcessLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each counter sample's value field, as one buffer with offsets and lengths."""
    n = len(lay.counters.values)
    values = np.empty((n, 10), np.uint8)
    values[:, :2] = np.frombuffer(_key(TE_DOUBLE_COUNTER_VALUE, _WT_I64), np.uint8)
    values[:, 2:] = lay.counters.values.astype("<f8").view(np.uint8).reshape(-1, 8)
    return values.reshape(-1), np.arange(n) * 10, np.full(n, 10)


def _packets(lay: ProcessLayout, kind: np.ndarray, ref: np.ndarray, ts_us: np.ndarray,
             payloads: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], pid: np.ndarray,
             firsts: list[tuple[int, bytes]], prefix: list[bytes] | None = None) -> Rows:
    """These events (of :func:`_event_order`) as TracePackets of the sequences ``pid`` (per event).
    ``firsts``: (row, interned names) where a sequence starts; ``prefix``: bytes written before each of
    those rows (its process's descriptors). ``payloads`` holds, per event kind, what each event carries
    after its name (annotations, a value)."""
    n = len(kind)
    spans, inst, ctr = lay.spans, lay.instants, lay.counters
    rows = [np.flatnonzero(kind == k) for k in (BEGIN, END, INSTANT, COUNTER)]
    span_rows = np.flatnonzero(kind <= END)

    def column(values_by_kind: dict[int, np.ndarray]) -> np.ndarray:
        out = np.zeros(n, np.int64)
        for k, values in values_by_kind.items():
            out[rows[k]] = values
        return out

    event = Rows(n)
    event.lookup([uint_field(TE_TYPE, k + 1) for k in (BEGIN, END, INSTANT, COUNTER)], kind)
    uuid = column({INSTANT: _track_uuid(pid[rows[INSTANT]], inst.track[ref[rows[INSTANT]]]),
                   COUNTER: _counter_uuid(pid[rows[COUNTER]], ctr.key[ref[rows[COUNTER]]])})
    uuid[span_rows] = _track_uuid(pid[span_rows], spans.track[ref[span_rows]])
    event.field(TE_TRACK_UUID, uuid)
    named = (kind == BEGIN) | (kind == INSTANT)
    iid = column({BEGIN: spans.name[ref[rows[BEGIN]]], INSTANT: inst.name[ref[rows[INSTANT]]]}) + 1
    event.field(TE_NAME_IID, iid, named)
    for k, (data, starts, lens) in payloads.items():
        event.ragged(data, column({k: starts[ref[rows[k]]]}), column({k: lens[ref[rows[k]]]}))
    packet = Rows(n)
    packet.field(PKT_TIMESTAMP, ts_us * 1000)
    packet.field(PKT_SEQUENCE_ID, pid)
    flags = np.where(named, 0, -1)
    start = np.full(n, -1)
    if firsts:  # a sequence's first packet clears its state and interns every name
        at = np.array([row for row, _ in firsts])
        flags[at] = 1
        start[at] = np.arange(at.size)
        packet.lookup([names for _, names in firsts], start)
    packet.lookup([uint_field(PKT_SEQUENCE_FLAGS, SEQ_NEEDS_INCREMENTAL_STATE),
                   uint_field(PKT_SEQUENCE_FLAGS, SEQ_NEEDS_INCREMENTAL_STATE | SEQ_INCREMENTAL_STATE_CLEARED)], flags)
    packet.message(PKT_TRACK_EVENT, event)
    trace = Rows(n)
    if prefix:
        trace.lookup(prefix, start)
    trace.message(TRACE_PACKET, packet)
    return trace


def _interned_names(names: list[str]) -> bytes:
    """InternedData with every event name of the sequence: name code i has iid i + 1."""
    entries = (bytes_field(ID_EVENT_NAMES, uint_field(EN_IID, i + 1) + str_field(EN_NAME, name))
               for i, name in enumerate(names))
    return bytes_field(PKT_INTERNED_DATA, b"".join(entries))
