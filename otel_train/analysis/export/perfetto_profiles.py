"""``export --profiles --format perfetto``: the profiler windows of a run as Perfetto TracePackets,
appended to the run's Perfetto export (docs/profiling.md).

The windows are placed once, by the Chrome merge (``profiles.merge``: Kineto's clock onto the records',
the export's host offsets, the trace's origin), on a Chrome export of the same run and options; this
module turns those events into packets: one track per profiler thread or stream (``profiler: …``),
a child of the rank's process track, and a begin and an end for each event, on a packet sequence of
its own, in time order and strictly nested (an event that outlasts the one it starts in is cut at its
end). Protobuf's repeated fields concatenate, so the packets are appended to the file as they are.
"""

from __future__ import annotations

from typing import Any

from otel_train.analysis.protowire import bytes_field, process_uuid, str_field, uint_field

TRACE_PACKET = 1
PKT_TIMESTAMP = 8
PKT_SEQUENCE_ID = 10
PKT_TRACK_EVENT = 11
PKT_TRACK_DESCRIPTOR = 60
TD_UUID, TD_NAME, TD_PARENT_UUID = 1, 2, 5
TE_TYPE, TE_TRACK_UUID, TE_NAME = 9, 11, 23
SLICE_BEGIN, SLICE_END = 1, 2
PROFILE_UUID_BASE = 3 << 22
"""Profiler tracks' uuids within a process's block of ``UUID_STRIDE``: above its span and counter tracks'."""
SEQUENCE_BASE = 1 << 30
"""Their packet sequences: above every process's (a process's sequence id is its synthetic pid)."""


def packets(doc: dict[str, Any]) -> bytes:
    """The Chrome export ``doc``'s profiler tracks and events (those ``profiles.merge`` added) as packets."""
    origin_us = float((doc.get("otherData") or {}).get("trace_start_unix_us", 0))
    names = {(e["pid"], e["tid"]): str(e["args"]["name"]) for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"
             and str((e.get("args") or {}).get("name", "")).startswith("profiler: ")}
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {key: [] for key in names}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and str(e.get("cat", "")).startswith("profiler.") and (e["pid"], e["tid"]) in by_track:
            by_track[(e["pid"], e["tid"])].append(e)
    out = []
    for k, ((pid, tid), events) in enumerate(sorted(by_track.items())):
        uuid = process_uuid(pid) + PROFILE_UUID_BASE + k
        descriptor = (uint_field(TD_UUID, uuid) + uint_field(TD_PARENT_UUID, process_uuid(pid))
                      + str_field(TD_NAME, names[(pid, tid)]))
        out.append(bytes_field(TRACE_PACKET, bytes_field(PKT_TRACK_DESCRIPTOR, descriptor)))
        out.extend(_slices(events, uuid, SEQUENCE_BASE + k, origin_us))
    return b"".join(out)


def _slices(events: list[dict[str, Any]], uuid: int, sequence: int, origin_us: float) -> list[bytes]:
    """Begins and ends of one track's events, in time order and strictly nested."""
    marks: list[tuple[int, int, str]] = []  # (ns, kind, name), an end before a begin at the same time
    stack: list[int] = []  # the open slices' ends
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
        start = round((origin_us + float(e["ts"])) * 1000)
        end = start + max(0, round(float(e.get("dur", 0)) * 1000))
        while stack and stack[-1] <= start:
            marks.append((stack.pop(), SLICE_END, ""))
        if stack:
            end = min(end, stack[-1])  # cut at the end of the slice it starts in
        marks.append((start, SLICE_BEGIN, str(e.get("name", ""))))
        stack.append(end)
    while stack:
        marks.append((stack.pop(), SLICE_END, ""))
    return [_event(ns, kind, name, uuid, sequence) for ns, kind, name in marks]


def _event(ns: int, kind: int, name: str, uuid: int, sequence: int) -> bytes:
    event = uint_field(TE_TYPE, kind) + uint_field(TE_TRACK_UUID, uuid) + (str_field(TE_NAME, name) if name else b"")
    packet = uint_field(PKT_TIMESTAMP, ns) + uint_field(PKT_SEQUENCE_ID, sequence) + bytes_field(PKT_TRACK_EVENT, event)
    return bytes_field(TRACE_PACKET, packet)
