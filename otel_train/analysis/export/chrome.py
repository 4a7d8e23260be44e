"""Chrome trace JSON (Perfetto UI, chrome://tracing), one process at a time (docs/export.md).

One process per (rank, attempt) with a synthetic pid, named ``rank 3`` / ``rank 3 (attempt 1)``,
labelled with host and real pid, sorted by rank; one thread per track; spans as complete events
(``X``), instants as thread-scoped instant events (``i``), scalars as counters (``C``). Timestamps are
whole microseconds since the trace start, whose Unix time is kept in ``otherData.trace_start_unix_us``;
whole microseconds make rounding monotonic, so nesting survives it exactly.

Events are written from the layout's columns: one ``%`` format over a whole process's slices (a C
loop), the per-span pieces looked up by code (name heads, status, attribute and error tails).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from itertools import chain
from typing import IO, Any

import msgspec
import numpy as np

from otel_train._version import __version__
from otel_train.analysis.export.layout import NO_STEP, Counts, ProcessLayout, track_tid

HEAD = b'{"displayTimeUnit":"ms","traceEvents":[\n'
"""What the file starts with."""
SEPARATOR = b",\n"
"""What goes between two processes' events."""
ERROR_CNAME = "terrible"
CHUNK = 16384
"""Events formatted at a time: what a process needs beyond its layout stays bounded."""

_encode = msgspec.json.Encoder().encode


def _json(value: object) -> str:
    return _encode(value).decode()


def render(lay: ProcessLayout, origin_us: int, out: IO[bytes]) -> Counts:
    """Write one laid-out process's events (comma separated) to ``out``, a chunk of slices or counter
    samples at a time; its counts. ``origin_us`` is the trace start in Unix µs."""
    texts = chain([_metadata(lay)], _slices(lay, origin_us), [_instants(lay, origin_us)], _counters(lay, origin_us))
    first = True
    for text in texts:
        if text:
            if not first:
                out.write(b",\n")
            out.write(text.encode())
            first = False
    return Counts(len(lay.spans.start_us), len(lay.instants.ts_us), len(lay.counters.ts_us), 1)


def tail(origin_us: int, processes: int, malformed: int, clock: Any = None) -> bytes:
    """What closes the file: ``otherData`` with the trace start, process and malformed-line counts, and
    the clock offsets applied (docs/clock.md)."""
    other = {
        "generator": f"otel-train {__version__}",
        "trace_start_unix_us": origin_us,
        "trace_start_utc": datetime.fromtimestamp(origin_us / 1e6, timezone.utc).isoformat(),
        "time_unit": "us since trace_start_unix_us",
        "processes": processes,
        "malformed_lines": malformed,
        "clock": clock.metadata() if clock is not None else {"aligned": False, "hosts": []},
    }
    return b'\n],"otherData":' + _encode(other) + b"}\n"


def _meta(name: str, pid: int, tid: int, args: dict) -> str:
    return f'{{"ph":"M","name":"{name}","pid":{pid},"tid":{tid},"args":{_json(args)}}}'


def _metadata(lay: ProcessLayout) -> str:
    pid = lay.pid
    events = [_meta("process_name", pid, 0, {"name": lay.name}),
              _meta("process_sort_index", pid, 0, {"sort_index": lay.index})]
    if lay.labels:
        events.append(_meta("process_labels", pid, 0, {"labels": lay.labels}))
    for track in lay.tracks:
        tid = track_tid(pid, track.index)
        events.append(_meta("thread_name", pid, tid, {"name": track.name}))
        events.append(_meta("thread_sort_index", pid, tid, {"sort_index": track.index}))
    return ",\n".join(events)


def _slices(lay: ProcessLayout, origin_us: int) -> Iterator[str]:
    """Every span as an ``X`` event, :data:`CHUNK` at a time: one format string per chunk, filled from
    the columns."""
    spans = lay.spans
    n = len(spans.start_us)
    if not n:
        return
    heads = np.array([f'{{"ph":"X","name":{_json(name)},"cat":"span","ts":' for name in lay.names], object)
    has_step = not (spans.step == NO_STEP).any()
    step = '"step":%d,' if has_step else "%s"
    row = '%s%d,"dur":%d,"pid":' + str(lay.pid) + ',"tid":%d,"args":{' + step + '"span_id":"%s",%s'
    tails = _tails(lay)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        steps = spans.step[a:b].tolist()
        if not has_step:
            steps = ["" if s == NO_STEP else f'"step":{s},' for s in steps]
        columns = (heads[spans.name[a:b]].tolist(), (spans.start_us[a:b] - origin_us).tolist(),
                   (spans.end_us[a:b] - spans.start_us[a:b]).tolist(), track_tid(lay.pid, spans.track[a:b]).tolist(),
                   steps, _span_ids(spans.span_ids[a:b]), tails[a:b])
        yield ",\n".join([row] * (b - a)) % tuple(chain.from_iterable(zip(*columns)))


_PLAIN = bytes(range(0x20, 0x7F)).replace(b'"', b"").replace(b"\\", b"")
"""Characters a JSON string holds as they are."""


def _span_ids(ids: np.ndarray) -> list[str]:
    """Span ids (a UTF-8 bytes column) as JSON string contents: as they are when all of them are printable
    ASCII of one length (one check for all), else each decoded and escaped."""
    if not ids.tobytes().translate(None, _PLAIN):
        return ids.astype("U").tolist()
    return [_json(sid.decode("utf-8", "replace"))[1:-1] for sid in ids.tolist()]


def _tails(lay: ProcessLayout) -> list[str]:
    """Each span's args after ``span_id`` (status, attributes, error, incomplete) and the event's end:
    made once per distinct (status, attributes, incomplete, failed), per span only for errors."""
    spans = lay.spans
    status_json = [_json(s) for s in lay.statuses]
    attrs_json = [_json(a)[1:-1] for a in lay.attrs]
    key = ((spans.status * (len(lay.attrs) + 1) + spans.attrs + 1) * 2 + spans.incomplete) * 2 + spans.failed
    kinds, of_span = np.unique(key, return_inverse=True)

    def tail_of(status: int, attrs: int, incomplete: bool, failed: bool, error: dict | None = None,
                args: str = "", event: str = "") -> str:
        text = '"status":' + status_json[status]
        if attrs >= 0:
            text += "," + attrs_json[attrs]
        if error is not None:
            text += ',"error":' + _json(error)
        if incomplete:
            text += ',"incomplete":true'
        return text + args + "}" + (f',"cname":"{ERROR_CNAME}"' if failed else "") + event + "}"

    width = len(lay.attrs) + 1
    table = np.array([tail_of(k // 4 // width, k // 4 % width - 1, bool(k & 2), bool(k & 1))
                      for k in kinds.tolist()], object)
    out = table[of_span.reshape(-1)].tolist()
    for i, error in spans.errors.items():
        out[i] = tail_of(int(spans.status[i]), int(spans.attrs[i]), bool(spans.incomplete[i]), True, error)
    flows = lay.flows
    if flows is not None:  # comm spans: the flow (v2: bind_id, flow_in, flow_out) and the last-arrival mark
        for i, flow, into, out_of, last in zip(flows.span.tolist(), flows.flow.tolist(), flows.flow_in.tolist(),
                                               flows.flow_out.tolist(), flows.last_arrival.tolist()):
            event = f',"bind_id":"{flow:#x}"' if flow else ""
            event += ',"flow_in":true' if flow and into else ""
            event += ',"flow_out":true' if flow and out_of else ""
            out[i] = tail_of(int(spans.status[i]), int(spans.attrs[i]), bool(spans.incomplete[i]),
                             bool(spans.failed[i]), spans.errors.get(i), ',"last_arrival":true' if last else "", event)
    return out


def _instants(lay: ProcessLayout, origin_us: int) -> str:
    inst = lay.instants
    if not len(inst.ts_us):
        return ""
    names = [_json(name) for name in lay.names]
    row = '{"ph":"i","s":"t","name":%s,"cat":"instant","ts":%d,"pid":' + str(lay.pid) + ',"tid":%d,"args":%s}'
    columns = ([names[c] for c in inst.name.tolist()], (inst.ts_us - origin_us).tolist(),
               track_tid(lay.pid, inst.track).tolist(), [_json(a) for a in inst.args])
    return ",\n".join([row] * len(inst.args)) % tuple(chain.from_iterable(zip(*columns)))


def _counters(lay: ProcessLayout, origin_us: int) -> Iterator[str]:
    counters = lay.counters
    n = len(counters.values)
    keys = np.array([_json(key) for key in lay.counter_keys], object)
    row = '{"ph":"C","name":%s,"ts":%d,"pid":' + str(lay.pid) + ',"args":{"value":%s}}'
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        numbers = counters.values[a:b].tolist()
        for i in np.flatnonzero(counters.integral[a:b]).tolist():
            numbers[i] = int(numbers[i])
        values = _json(numbers)[1:-1].split(",")  # numbers only: the commas separate them
        columns = (keys[counters.key[a:b]].tolist(), (counters.ts_us[a:b] - origin_us).tolist(), values)
        yield ",\n".join([row] * (b - a)) % tuple(chain.from_iterable(zip(*columns)))
