"""Perfetto's native trace format: a stream of ``TracePacket`` protobufs, hand-encoded.

Field numbers come from perfetto's ``trace_packet.proto``, ``track_event.proto``,
``track_descriptor.proto``, ``process_descriptor.proto``, ``thread_descriptor.proto``,
``interned_data.proto`` and ``debug_annotation.proto``. Each track gets its own packet sequence,
whose events are written in time order (slice ends before the next begin at the same timestamp),
so the trace processor never has to reorder a track; event names are interned per sequence.
Timestamps are absolute Unix nanoseconds at microsecond resolution (the UI shows them relative to
the trace start itself), so the same layout as the Chrome JSON export survives exactly.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable, Iterator
from typing import IO

import msgspec

from otel_train import schema
from otel_train.analysis.chrome import scalar_values, track_tid
from otel_train.analysis.spans import ProcessState, Span
from otel_train.analysis.tracks import ProcessLayout, is_incomplete, layout_process

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
TE_CATEGORIES = 22
TE_DOUBLE_COUNTER_VALUE = 44
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

_WT_VARINT, _WT_I64, _WT_LEN = 0, 1, 2
_UUID_STRIDE = 1 << 24
_COUNTER_UUID_BASE = 1 << 23
_INT64_MAX = (1 << 63) - 1
_pack_double = struct.Struct("<d").pack
_encode_json = msgspec.json.Encoder().encode


def varint(n: int) -> bytes:
    """Base-128 varint; negative numbers as their 64-bit two's complement (protobuf int64)."""
    if n < 0:
        n &= (1 << 64) - 1
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def uint_field(field: int, value: int) -> bytes:
    """A varint field (uint64, int64, int32, bool, enum)."""
    return _key(field, _WT_VARINT) + varint(value)


def bytes_field(field: int, value: bytes) -> bytes:
    """A length-delimited field (bytes, string, embedded message)."""
    return _key(field, _WT_LEN) + varint(len(value)) + value


def str_field(field: int, value: str) -> bytes:
    """A string field."""
    return bytes_field(field, value.encode("utf-8", "replace"))


def double_field(field: int, value: float) -> bytes:
    """A double field (fixed 64-bit)."""
    return _key(field, _WT_I64) + _pack_double(value)


def _ns(ts: float) -> int:
    """Unix seconds to nanoseconds, rounded to the microsecond (the records' real precision)."""
    return int(ts * 1e6 + 0.5) * 1000


def debug_annotation(name: str, value: object) -> bytes:
    """One named argument; lists and dicts are kept as JSON text."""
    if type(value) is bool:
        body = uint_field(DA_BOOL, int(value))
    elif isinstance(value, int) and -_INT64_MAX - 1 <= value <= _INT64_MAX:
        body = uint_field(DA_INT, value)
    elif isinstance(value, (int, float)):
        body = double_field(DA_DOUBLE, float(value))
    elif isinstance(value, str):
        body = str_field(DA_STRING, value)
    else:
        body = str_field(DA_STRING, _encode_json(value).decode())
    return bytes_field(TE_DEBUG_ANNOTATIONS, str_field(DA_NAME, name) + body)


class _Sequence:
    """One trusted packet sequence: its id, and the event names interned on it so far."""

    __slots__ = ("seq_id", "names", "_prefix")

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.names: dict[str, int] = {}
        self._prefix = uint_field(PKT_SEQUENCE_ID, seq_id)

    def packet(self, ts_ns: int, event: bytes, name: str | None = None) -> bytes:
        """A TracePacket holding ``event`` (a TrackEvent body), interning ``name`` when new."""
        body = uint_field(PKT_TIMESTAMP, ts_ns) + self._prefix
        if name is not None:
            iid = self.names.get(name)
            if iid is None:
                iid = self.names[name] = len(self.names) + 1
                flags = SEQ_NEEDS_INCREMENTAL_STATE | (SEQ_INCREMENTAL_STATE_CLEARED if iid == 1 else 0)
                entry = uint_field(EN_IID, iid) + str_field(EN_NAME, name)
                body += bytes_field(PKT_INTERNED_DATA, bytes_field(ID_EVENT_NAMES, entry))
            else:
                flags = SEQ_NEEDS_INCREMENTAL_STATE
            body += uint_field(PKT_SEQUENCE_FLAGS, flags)
            event += uint_field(TE_NAME_IID, iid)
        return bytes_field(TRACE_PACKET, body + bytes_field(PKT_TRACK_EVENT, event))


def write_perfetto(traces: Iterable[ProcessState], f: IO[bytes]) -> tuple[int, int, int, int]:
    """Stream ``traces`` as a Perfetto protobuf trace; returns (slices, instants, counters, processes)."""
    slices = instants = counters = processes = 0
    next_seq = 1
    for index, trace in enumerate(traces):
        lay = layout_process(trace, index)
        chunks: list[bytes] = _descriptors(lay)
        per_track_spans: list[list[int]] = [[] for _ in lay.tracks]
        for i, track in enumerate(lay.span_tracks):
            per_track_spans[track].append(i)
        per_track_instants: list[list[int]] = [[] for _ in lay.tracks]
        for i, track in enumerate(lay.instant_tracks):
            per_track_instants[track].append(i)
        for track in lay.tracks:
            seq = _Sequence(next_seq)
            next_seq += 1
            uuid = _track_uuid(lay, track.index)
            chunks.extend(_track_packets(lay, seq, uuid, per_track_spans[track.index],
                                         per_track_instants[track.index]))
        n_counters, counter_chunks = _counter_packets(lay, _Sequence(next_seq))
        next_seq += 1
        chunks.extend(counter_chunks)
        f.write(b"".join(chunks))
        slices += len(lay.span_tracks)
        instants += len(lay.instant_tracks)
        counters += n_counters
        processes += 1
    return slices, instants, counters, processes


def _process_uuid(lay: ProcessLayout) -> int:
    return lay.pid * _UUID_STRIDE


def _track_uuid(lay: ProcessLayout, track_index: int) -> int:
    return lay.pid * _UUID_STRIDE + 1 + track_index


def _descriptor(body: bytes) -> bytes:
    return bytes_field(TRACE_PACKET, bytes_field(PKT_TRACK_DESCRIPTOR, body))


def _descriptors(lay: ProcessLayout) -> list[bytes]:
    pid = lay.pid
    name = f"{lay.name} ({lay.labels})" if lay.labels else lay.name
    process = uint_field(PD_PID, pid) + str_field(PD_NAME, name)
    out = [_descriptor(uint_field(TD_UUID, _process_uuid(lay)) + bytes_field(TD_PROCESS, process))]
    for track in lay.tracks:
        thread = (uint_field(THD_PID, pid) + uint_field(THD_TID, track_tid(lay, track.index))
                  + str_field(THD_NAME, track.name))
        out.append(_descriptor(uint_field(TD_UUID, _track_uuid(lay, track.index)) + bytes_field(TD_THREAD, thread)))
    return out


def _slice_order(lay: ProcessLayout, spans: list[int]) -> Iterator[tuple[int, int, int]]:
    """(ts_ns, type, span index) of one track's begins and ends, properly bracketed in time order."""
    stack: list[tuple[int, int]] = []
    all_spans = lay.trace.spans
    for i in spans:
        start = _ns(all_spans[i].start_ts)
        while stack and stack[-1][0] <= start:
            end, j = stack.pop()
            yield end, TYPE_SLICE_END, j
        yield start, TYPE_SLICE_BEGIN, i
        stack.append((_ns(lay.ends[i]), i))
    while stack:
        end, j = stack.pop()
        yield end, TYPE_SLICE_END, j


def _track_packets(
    lay: ProcessLayout, seq: _Sequence, uuid: int, spans: list[int], instants: list[int]
) -> Iterator[bytes]:
    on_track = uint_field(TE_TRACK_UUID, uuid)
    all_spans = lay.trace.spans
    recs = lay.trace.instants
    instant_events = sorted((_ns(recs[i].ts), TYPE_INSTANT, i) for i in instants)
    for ts, kind, i in heapq.merge(_slice_order(lay, spans), instant_events, key=lambda e: e[0]):
        if kind == TYPE_SLICE_END:
            yield seq.packet(ts, uint_field(TE_TYPE, TYPE_SLICE_END) + on_track)
        elif kind == TYPE_SLICE_BEGIN:
            span = all_spans[i]
            yield seq.packet(ts, uint_field(TE_TYPE, TYPE_SLICE_BEGIN) + on_track + _span_annotations(span),
                             span.name)
        else:
            rec = recs[i]
            args = b""
            if rec.step is not None:
                args += debug_annotation(schema.STEP, rec.step)
            if rec.attrs:
                args += b"".join(debug_annotation(str(k), v) for k, v in rec.attrs.items())
            yield seq.packet(ts, uint_field(TE_TYPE, TYPE_INSTANT) + on_track + args, rec.name)


def _span_annotations(span: Span) -> bytes:
    out = []
    if span.step is not None:
        out.append(debug_annotation(schema.STEP, span.step))
    out.append(debug_annotation(schema.SPAN_ID, span.span_id))
    out.append(debug_annotation(schema.STATUS, span.status))
    for key, value in (span.attrs or {}).items():
        out.append(debug_annotation(str(key), value))
    if span.error is not None:
        out.append(debug_annotation(schema.ERROR, span.error))
    if is_incomplete(span):
        out.append(debug_annotation("incomplete", True))
    return b"".join(out)


def _counter_packets(lay: ProcessLayout, seq: _Sequence) -> tuple[int, list[bytes]]:
    """Counter track descriptors and values: one counter track per scalar key."""
    uuids: dict[str, int] = {}
    out: list[bytes] = []
    events: list[bytes] = []
    for rec in sorted(lay.trace.scalars, key=lambda r: r.ts):
        ts = _ns(rec.ts)
        for key, value in scalar_values(rec):
            uuid = uuids.get(key)
            if uuid is None:
                uuid = uuids[key] = _process_uuid(lay) + _COUNTER_UUID_BASE + len(uuids)
                out.append(_descriptor(uint_field(TD_UUID, uuid) + uint_field(TD_PARENT_UUID, _process_uuid(lay))
                                       + str_field(TD_NAME, key) + bytes_field(TD_COUNTER, b"")))
            event = (uint_field(TE_TYPE, TYPE_COUNTER) + uint_field(TE_TRACK_UUID, uuid)
                     + double_field(TE_DOUBLE_COUNTER_VALUE, float(value)))
            events.append(seq.packet(ts, event))
    return len(events), out + events

