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

from datetime import datetime, timezone
from itertools import chain

import msgspec
import numpy as np

from otel_train._version import __version__
from otel_train.analysis.export.layout import NO_STEP, Counts, ProcessLayout, layout_process, track_tid
from otel_train.analysis.spans import ProcessState

HEAD = b'{"displayTimeUnit":"ms","traceEvents":[\n'
"""What the file starts with."""
SEPARATOR = b",\n"
"""What goes between two processes' events."""
ERROR_CNAME = "terrible"

_encode = msgspec.json.Encoder().encode


def _json(value: object) -> str:
    return _encode(value).decode()


def render(state: ProcessState, index: int, origin_us: int) -> tuple[bytes, Counts]:
    """One process's events (comma separated) and counts; ``index`` is its place in the export
    (synthetic pid ``index + 1``), ``origin_us`` the trace start in Unix µs."""
    lay = layout_process(state, index)
    events = [_metadata(lay), _slices(lay, origin_us), _instants(lay, origin_us), _counters(lay, origin_us)]
    counts = Counts(len(lay.spans.start_us), len(lay.instants.ts_us), len(lay.counters.ts_us), 1)
    return ",\n".join(e for e in events if e).encode(), counts


def tail(origin_us: int, processes: int, malformed: int) -> bytes:
    """What closes the file: ``otherData`` with the trace start, process and malformed-line counts."""
    other = {
        "generator": f"otel-train {__version__}",
        "trace_start_unix_us": origin_us,
        "trace_start_utc": datetime.fromtimestamp(origin_us / 1e6, timezone.utc).isoformat(),
        "time_unit": "us since trace_start_unix_us",
        "processes": processes,
        "malformed_lines": malformed,
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


def _slices(lay: ProcessLayout, origin_us: int) -> str:
    """Every span as an ``X`` event: one format string per process, filled from the columns."""
    spans = lay.spans
    n = len(spans.start_us)
    if not n:
        return ""
    heads = np.array([f'{{"ph":"X","name":{_json(name)},"cat":"span","ts":' for name in lay.names], object)
    ts = spans.start_us - origin_us
    tids = track_tid(lay.pid, spans.track)
    steps = spans.step.tolist()
    if (spans.step == NO_STEP).any():
        steps = ["" if s == NO_STEP else f'"step":{s},' for s in steps]
        row = '%s%d,"dur":%d,"pid":%d,"tid":%d,"args":{%s"span_id":"%s",%s'
    else:
        row = '%s%d,"dur":%d,"pid":%d,"tid":%d,"args":{"step":%d,"span_id":"%s",%s'
    columns = (heads[spans.name].tolist(), ts.tolist(), (spans.end_us - spans.start_us).tolist(),
               [lay.pid] * n, tids.tolist(), steps, _span_ids(spans.span_ids), _tails(lay))
    return ",\n".join([row] * n) % tuple(chain.from_iterable(zip(*columns)))


_PLAIN = bytes(range(0x20, 0x7F)).replace(b'"', b"").replace(b"\\", b"")
"""Characters a JSON string holds as they are."""


def _span_ids(ids: list[str]) -> list[str]:
    """Span ids as JSON string contents (ids need no escaping as a rule: one check for all of them)."""
    joined = "".join(ids)
    if joined.isascii() and not joined.encode().translate(None, _PLAIN):
        return ids
    return [_json(sid)[1:-1] for sid in ids]


def _tails(lay: ProcessLayout) -> list[str]:
    """Each span's args after ``span_id`` (status, attributes, error, incomplete) and the event's end:
    made once per distinct (status, attributes, incomplete, failed), per span only for errors."""
    spans = lay.spans
    status_json = [_json(s) for s in lay.statuses]
    attrs_json = [_json(a)[1:-1] for a in lay.attrs]
    key = ((spans.status * (len(lay.attrs) + 1) + spans.attrs + 1) * 2 + spans.incomplete) * 2 + spans.failed
    kinds, of_span = np.unique(key, return_inverse=True)

    def tail_of(status: int, attrs: int, incomplete: bool, failed: bool, error: dict | None = None) -> str:
        text = '"status":' + status_json[status]
        if attrs >= 0:
            text += "," + attrs_json[attrs]
        if error is not None:
            text += ',"error":' + _json(error)
        if incomplete:
            text += ',"incomplete":true'
        return text + "}" + (f',"cname":"{ERROR_CNAME}"' if failed else "") + "}"

    width = len(lay.attrs) + 1
    table = np.array([tail_of(k // 4 // width, k // 4 % width - 1, bool(k & 2), bool(k & 1))
                      for k in kinds.tolist()], object)
    out = table[of_span.reshape(-1)].tolist()
    for i, error in spans.errors.items():
        out[i] = tail_of(int(spans.status[i]), int(spans.attrs[i]), bool(spans.incomplete[i]), True, error)
    return out


def _instants(lay: ProcessLayout, origin_us: int) -> str:
    inst = lay.instants
    if not len(inst.ts_us):
        return ""
    names = [_json(name) for name in lay.names]
    row = '{"ph":"i","s":"t","name":%s,"cat":"instant","ts":%d,"pid":%d,"tid":%d,"args":%s}'
    columns = ([names[c] for c in inst.name.tolist()], (inst.ts_us - origin_us).tolist(), [lay.pid] * len(inst.args),
               track_tid(lay.pid, inst.track).tolist(), [_json(a) for a in inst.args])
    return ",\n".join([row] * len(inst.args)) % tuple(chain.from_iterable(zip(*columns)))


def _counters(lay: ProcessLayout, origin_us: int) -> str:
    counters = lay.counters
    n = len(counters.values)
    if not n:
        return ""
    keys = np.array([_json(key) for key in lay.counter_keys], object)
    row = '{"ph":"C","name":%s,"ts":%d,"pid":%d,"args":{"value":%r}}'
    columns = (keys[counters.key].tolist(), (counters.ts_us - origin_us).tolist(), [lay.pid] * n, counters.values)
    return ",\n".join([row] * n) % tuple(chain.from_iterable(zip(*columns)))
