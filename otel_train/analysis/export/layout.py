"""What every export format shares: a process laid out as columns, ready to write (docs/export.md).

Perfetto and chrome://tracing draw a track as a stack: two slices on it must either be disjoint or
one must contain the other, or the viewer drops or spills them. Spans of one task nest naturally,
but concurrent tasks (threads, asyncio tasks) overlap without nesting, so they need tracks of their
own. The rule (:func:`greedy_tracks`) is a sweep in start order: a span joins its parent's track when
the parent is the innermost open slice there (same thread, and the parent contains it), else the
first idle track of its thread, else a new track; sequential tasks therefore reuse tracks.

:func:`track_columns` applies that rule with numpy: a thread whose spans all satisfy it on one track
(every span starts on an idle track or inside its parent, the innermost open span) is checked with
array operations and gets one track; only threads with overlapping tasks run the sweep itself.

:func:`layout_process` turns a finished ``ProcessState`` into what every writer emits: display names,
synthetic pid, tracks, and columns of spans (whole-µs start and effective end, track, name, step,
status and attribute codes), instants and counter samples.
"""

from __future__ import annotations

import math
from itertools import repeat
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np

from otel_train import schema
from otel_train.analysis.records import Instant, Scalar
from otel_train.analysis.spans import ProcessState, Span

DEFAULT_SOURCE = "training"
TID_STRIDE = 100_000
"""Track k of process pid gets tid ``pid * TID_STRIDE + k + 1``: unique across the whole trace."""
NO_STEP = -1
"""Step column value of a span, instant or counter recorded outside any step."""
COMM_TID = "comm"
"""The thread key of a process's comm track: every ``comm.*`` span goes there, whichever thread issued it."""

_encode = msgspec.json.Encoder().encode


class Counts(NamedTuple):
    """What a format writer wrote: slices (spans), instants, counter samples, processes."""

    slices: int
    instants: int
    counters: int
    processes: int


@dataclass(slots=True)
class Track:
    """One drawable track: a thread's slices, or one of its concurrent tasks."""

    index: int
    tid: int | None
    name: str = ""


class Codes:
    """Values numbered in order of first appearance: ``codes(keys)`` -> int array; ``values`` is the table."""

    __slots__ = ("index", "values")

    def __init__(self) -> None:
        self.index: dict[Hashable, int] = {}
        self.values: list[Any] = []

    def __call__(self, keys: Iterable[Hashable], values: Iterable[Any] | None = None) -> np.ndarray:
        """Codes of ``keys``; a new key's table entry is its value in ``values`` (default: the key),
        any of them for a key seen twice (equal keys must stand for equal values)."""
        keys = keys if isinstance(keys, list) else list(keys)
        index = self.index
        seen = dict(zip(keys, values)) if values is not None else dict.fromkeys(keys)
        for key, value in seen.items():
            if key not in index:
                index[key] = len(index)
                self.values.append(key if values is None else value)
        return np.fromiter(map(index.__getitem__, keys), np.int64, len(keys))


def whole_us(ts: np.ndarray) -> np.ndarray:
    """Unix seconds to whole Unix microseconds, rounded half up (rounding is monotonic: nesting survives)."""
    return np.floor(ts * 1e6 + 0.5).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Tracks


def greedy_tracks(starts: Sequence[float], ends: Sequence[float], tids: Sequence[int | None],
                  ids: Sequence[str | None], parents: Sequence[str | None]) -> tuple[list[int], list[Track], list[int]]:
    """The track rule as a sweep (see the module doc): each span's track, the tracks, and the span
    that opened each track. Spans must be in start order; ``ends`` are effective ends."""
    tracks: list[Track] = []
    stacks: list[tuple[list[float], list[str | None]]] = []  # open ends and ids per track, outermost first
    by_tid: dict[int | None, list[int]] = {}
    track_of: dict[str | None, int] = {}
    out: list[int] = []
    opened: list[int] = []
    for i, (start, end, tid, sid, parent) in enumerate(zip(starts, ends, tids, ids, parents)):
        index = track_of.get(parent) if parent else None
        if index is not None:  # the parent's track, if the parent is its innermost open slice and contains us
            if tracks[index].tid != tid or not _settle(stacks[index], start, parent, end):
                index = None
        if index is None:  # the first track of this thread with no slice open at ``start``
            index = next((k for k in by_tid.get(tid, ()) if not _settle(stacks[k], start, None, end)), None)
        if index is None:
            index = len(tracks)
            tracks.append(Track(index, tid))
            stacks.append(([], []))
            by_tid.setdefault(tid, []).append(index)
            opened.append(i)
        stacks[index][0].append(end)
        stacks[index][1].append(sid)
        track_of[sid] = index
        out.append(index)
    return out, tracks, opened


def _settle(stack: tuple[list[float], list[str | None]], start: float, parent: str | None, end: float) -> bool:
    """Close the slices of a track that ended at or before ``start``; then, whether ``parent`` is its
    innermost open slice and contains ``end`` (``parent`` None: whether anything is open)."""
    ends, ids = stack
    while ends and ends[-1] <= start:
        ends.pop()
        ids.pop()
    if parent is None:
        return bool(ends)
    return bool(ids) and ids[-1] == parent and end <= ends[-1]


def track_columns(start: np.ndarray, end: np.ndarray, tids: Sequence[int | None], ids: Sequence[str | None],
                  parents: Sequence[str | None]) -> tuple[np.ndarray, list[Track]]:
    """Track index of every span (in start order, ``end`` effective) and the tracks, named; the same
    result as :func:`greedy_tracks`, with the sweep run only for threads that need more than one track."""
    return _tracks(start, end, tids, ids, parents, dict(zip(ids, range(len(start)))))


def _tracks(start: np.ndarray, end: np.ndarray, tids: Sequence[int | None], ids: Sequence[str | None],
            parents: Sequence[str | None], position: dict[str | None, int]) -> tuple[np.ndarray, list[Track]]:
    """:func:`track_columns`, given each span id's (last) index."""
    n = len(start)
    tid_codes = Codes()
    thread = tid_codes(tids)
    if len(position) != n:  # a span id used twice: the sweep's "latest span with that id" rule decides
        out, tracks, _ = greedy_tracks(start.tolist(), end.tolist(), tids, ids, parents)
        _name_tracks(tracks)
        return np.asarray(out, np.int64), tracks
    if None in position or "" in position:  # an empty span id is nobody's parent
        parent = np.fromiter((position.get(p, -1) if p else -1 for p in parents), np.int64, n)
    else:
        parent = np.fromiter(map(position.get, parents, repeat(-1)), np.int64, n)
    single = _single_track_threads(start, end, thread, parent, len(tid_codes.values))
    # Every track with the span that opened it: a one-track thread's opens at the thread's first span.
    first_of_thread = np.unique(thread, return_index=True)[1]
    opening = [(int(first_of_thread[c]), tid_codes.values[c], -1 - int(c)) for c in np.flatnonzero(single)]
    slow = np.flatnonzero(~single[thread])
    local = np.zeros(0, np.int64)
    if len(slow):
        swept, made, first = greedy_tracks(start[slow].tolist(), end[slow].tolist(), [tids[i] for i in slow],
                                           [ids[i] for i in slow], [parents[i] for i in slow])
        local = np.asarray(swept, np.int64)
        opening += [(int(slow[f]), t.tid, t.index) for f, t in zip(first, made)]
    opening.sort()
    tracks = [Track(index, tid) for index, (_, tid, _) in enumerate(opening)]
    _name_tracks(tracks)
    of_thread = np.zeros(len(single), np.int64)
    of_local = np.zeros(len(opening), np.int64)
    for index, (_, _, key) in enumerate(opening):
        if key < 0:
            of_thread[-1 - key] = index
        else:
            of_local[key] = index
    track = of_thread[thread]
    track[slow] = of_local[local]
    return track, tracks


def _single_track_threads(start: np.ndarray, end: np.ndarray, thread: np.ndarray, parent: np.ndarray,
                          threads: int) -> np.ndarray:
    """Per thread code: whether the sweep puts all its spans on one track.

    It does when every span starts on an idle track (all earlier spans of the thread ended by its
    start) or inside its parent, which is then the innermost open span: the parent is earlier on the
    same thread, open at the start (ends after it), contains the span, and every span between the
    two ended by the start.
    """
    n = len(start)
    order = np.argsort(thread, kind="stable")  # threads' spans contiguous, each in start order
    if n == 0:
        return np.ones(threads, bool)
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    s, e, t = start[order], end[order], thread[order]
    cuts = [0, *(np.flatnonzero(np.diff(t)) + 1).tolist(), n]
    ended = np.full(n, -np.inf)  # the latest end among the thread's earlier spans
    for a, b in zip(cuts[:-1], cuts[1:]):
        ended[a + 1:b] = np.maximum.accumulate(e[a:b - 1])
    busy = np.flatnonzero(ended > s)  # spans that start while the thread has a span open
    p = parent[order][busy]
    p = np.where(p >= 0, rank[np.maximum(p, 0)], -1)
    first = np.searchsorted(t, t[busy], side="left")
    pe = e[np.maximum(p, 0)]
    inside = (p >= first) & (p < busy) & (pe > s[busy]) & (e[busy] <= pe)
    inside &= _range_max(e, np.where(inside, p + 1, busy), busy) <= s[busy]
    bad = np.bincount(t[busy[~inside]], minlength=threads)
    return bad == 0


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(values[lo[i]:hi[i]])`` for every i (-inf for an empty range): a sparse table, level by level."""
    out = np.full(len(lo), -np.inf)
    length = np.maximum(hi - lo, 0)
    level = values
    k = 0
    while True:
        width = 1 << k
        # Queries whose length has its top bit at k: two overlapping windows of ``width`` cover them.
        ask = (length >= width) & (length < 2 * width)
        if ask.any():
            a, b = lo[ask], hi[ask] - width
            out[ask] = np.maximum(level[a], level[b])
        if 2 * width > length.max(initial=0):
            return out
        level = np.maximum(level[:-width], level[width:])
        k += 1


def _name_tracks(tracks: list[Track]) -> None:
    per_tid: dict[int | None, int] = {}
    for track in tracks:
        k = per_tid[track.tid] = per_tid.get(track.tid, 0) + 1
        base = "main" if track.tid is None else COMM_TID if track.tid == COMM_TID else f"thread {track.tid}"
        track.name = base if k == 1 else f"{base} · task {k}"


def assign_tracks(spans: Sequence[Span], ends: Sequence[float]) -> tuple[list[int], list[Track]]:
    """Track index of every span (``spans`` in start order, ``ends[i]`` span i's effective end) and the
    tracks made; every track is strictly nested."""
    start = np.fromiter((s.start_ts for s in spans), np.float64, len(spans))
    track, tracks = track_columns(start, np.asarray(ends, np.float64), [s.tid for s in spans],
                                  [s.span_id for s in spans], [s.parent_span_id for s in spans])
    return track.tolist(), tracks


# ---------------------------------------------------------------------------------------------
# A process as columns


@dataclass(slots=True)
class SpanColumns:
    """A process's spans in start order: whole Unix µs, codes into the layout's tables, sparse extras."""

    start_us: np.ndarray
    end_us: np.ndarray  # effective end: an unclosed span runs to the process's last record
    track: np.ndarray
    name: np.ndarray  # codes into ProcessLayout.names
    step: np.ndarray  # NO_STEP when none
    status: np.ndarray  # codes into ProcessLayout.statuses
    attrs: np.ndarray  # codes into ProcessLayout.attrs; -1 when none or empty
    incomplete: np.ndarray  # bool: no end record, or ended as incomplete by shutdown
    failed: np.ndarray  # bool: an error, drawn red
    span_ids: np.ndarray  # UTF-8 bytes, fixed width ("S"): no Python object per span outlives the state
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)  # span index -> error


@dataclass(slots=True)
class InstantColumns:
    """A process's instants in record order: whole Unix µs, track, name code, args (step first)."""

    ts_us: np.ndarray
    track: np.ndarray
    name: np.ndarray
    args: list[dict[str, Any]]


@dataclass(slots=True)
class CounterColumns:
    """A process's counter samples in record order: whole Unix µs, key code, value, whether it was an int."""

    ts_us: np.ndarray
    key: np.ndarray  # codes into ProcessLayout.counter_keys
    values: np.ndarray  # float64: what a trace viewer holds anyway
    integral: np.ndarray  # bool: written as an integer


@dataclass(slots=True)
class FlowColumns:
    """The marked spans (sparse; comm spans are a small share): span index, flow id (0: none), whether
    the flow comes in and goes out there, whether the span is its collective's last arrival."""

    span: np.ndarray
    flow: np.ndarray
    flow_in: np.ndarray
    flow_out: np.ndarray
    last_arrival: np.ndarray


@dataclass(slots=True)
class ProcessLayout:
    """A process ready to write (see the module doc)."""

    index: int  # 0-based position in the export; the synthetic pid is index + 1
    name: str
    labels: str
    tracks: list[Track]
    spans: SpanColumns
    instants: InstantColumns
    counters: CounterColumns
    names: list[str]  # span and instant names
    statuses: list[str]
    attrs: list[dict[str, Any]]
    counter_keys: list[str]
    flows: FlowColumns | None = None  # comm spans' flows and last-arrival marks (docs/export.md)

    @property
    def pid(self) -> int:
        """Synthetic pid: real pids collide across hosts and containers."""
        return self.index + 1


def track_tid(pid: int, track_index: int | np.ndarray) -> int | np.ndarray:
    """The trace-wide thread id of a process's track (or of a column of tracks)."""
    return pid * TID_STRIDE + track_index + 1


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


def layout_process(trace: ProcessState, index: int, marks: Mapping[str, Any] | None = None) -> ProcessLayout:
    """Columns, tracks and display names of one finished ``keep=True`` process state; ``marks``: span id
    -> an object with ``flow``, ``flow_in``, ``flow_out``, ``last_arrival`` (export/flows.py)."""
    names, statuses, attrs = Codes(), Codes(), Codes()
    spans, tracks, position = _span_columns(trace, names, statuses, attrs)
    instants = _instant_columns(trace.instants, spans.track, position, tracks, names)
    counters, keys = _counter_columns(trace.scalars)
    return ProcessLayout(index, process_name(trace), process_labels(trace), tracks, spans, instants, counters,
                         names.values, statuses.values, attrs.values, keys, _flow_columns(marks, position))


def _flow_columns(marks: Mapping[str, Any] | None, position: dict[str | None, int]) -> FlowColumns | None:
    if not marks:
        return None
    found = sorted((position[sid], m) for sid, m in marks.items() if sid in position)
    if not found:
        return None
    index = np.fromiter((i for i, _ in found), np.int64, len(found))
    column = lambda name, dtype: np.fromiter((getattr(m, name) for _, m in found), dtype, len(found))  # noqa: E731
    return FlowColumns(index, column("flow", np.int64), column("flow_in", bool), column("flow_out", bool),
                       column("last_arrival", bool))


def _span_columns(trace: ProcessState, names: Codes, statuses: Codes, attrs: Codes
                  ) -> tuple[SpanColumns, list[Track], dict[str | None, int]]:
    spans = trace.spans
    n = len(spans)
    start = np.fromiter((s.start_ts for s in spans), np.float64, n)
    closed = np.array([s.end_ts for s in spans], np.float64)  # None (still open) -> nan
    last = trace.last_ts if trace.last_ts is not None else 0.0
    # Unclosed spans run to the last timestamp; a clock step backwards never gives a negative length.
    end = np.maximum(start, np.where(np.isnan(closed), last, closed))
    if n > 1:  # start order; of two that start together the longer first (a parent and its first child)
        gap = start[1:] - start[:-1]
        if bool((gap < 0).any()) or bool(((gap == 0) & (end[1:] > end[:-1])).any()):
            order = np.lexsort((-end, start))
            spans = trace.spans = [spans[i] for i in order]
            start, closed, end = start[order], closed[order], end[order]
    ids = [s.span_id for s in spans]
    position = dict(zip(ids, range(n)))
    name_codes = names([s.name for s in spans])
    track, tracks = _tracks(start, end, _comm_tids(spans, name_codes, names.values), ids,
                            [s.parent_span_id for s in spans], position)
    attr_codes = _attr_codes([s.attrs for s in spans], attrs)
    status = statuses([s.status for s in spans])
    error_list = [s.error for s in spans]
    errors = {} if error_list.count(None) == n else {i: e for i, e in enumerate(error_list) if e is not None}
    failed = status == statuses.index.get(schema.STATUS_ERROR, -1)
    failed[list(errors)] = True
    columns = SpanColumns(
        start_us=whole_us(start), end_us=whole_us(end), track=track, name=name_codes,
        step=_steps([s.step for s in spans]),
        status=status, attrs=attr_codes,
        incomplete=np.isnan(closed) | (status == statuses.index.get(schema.STATUS_INCOMPLETE, -1)),
        failed=failed, span_ids=utf8_column(ids), errors=errors,
    )
    return columns, tracks, position


def _comm_tids(spans: list[Span], name_codes: np.ndarray, names: list[str]) -> list[Any]:
    """The spans' thread keys, with every ``comm.*`` span on the comm track (:data:`COMM_TID`)."""
    tids: list[Any] = [s.tid for s in spans]
    comm = [code for code, name in enumerate(names) if schema.comm_op_of(name) is not None]
    if comm:
        for i in np.flatnonzero(np.isin(name_codes, comm)).tolist():
            tids[i] = COMM_TID
    return tids


def _attr_codes(attr_list: list[dict[str, Any] | None], attrs: Codes) -> np.ndarray:
    """Codes of the spans' attributes (equal JSON, equal code); -1 for none or empty."""
    codes = np.full(len(attr_list), -1, np.int64)
    given = [i for i, a in enumerate(attr_list) if a]
    if given:
        some = [attr_list[i] for i in given]
        codes[given] = attrs(map(_encode, some), some)
    return codes


def utf8_column(texts: list[str | None]) -> np.ndarray:
    """Strings as a fixed-width bytes column, UTF-8 encoded (None as empty)."""
    if None in texts:
        texts = [t or "" for t in texts]
    joined = "".join(texts)  # type: ignore[arg-type]
    widths = set(map(len, texts))  # type: ignore[arg-type]
    if len(widths) == 1 and joined and joined.isascii() and "\0" not in joined:  # one length, ASCII: one encode
        return np.frombuffer(joined.encode("ascii"), f"S{widths.pop()}")
    return np.array([t.encode("utf-8", "replace") for t in texts], dtype="S")  # type: ignore[union-attr]


def _steps(steps: list[int | None]) -> np.ndarray:
    """A step column: None -> NO_STEP (steps are at most 2**53, exact in float64)."""
    values = np.array(steps, np.float64)
    return np.where(np.isnan(values), NO_STEP, values).astype(np.int64)


def _instant_columns(recs: list[Instant], span_track: np.ndarray, position: dict[str | None, int],
                     tracks: list[Track], names: Codes) -> InstantColumns:
    """An instant goes on its enclosing span's track, else its thread's first track, else a new one."""
    first_of_tid: dict[int | None, int] = {}
    for track in tracks:
        first_of_tid.setdefault(track.tid, track.index)
    out = []
    for rec in recs:
        i = position.get(rec.span_id or "")
        if i is not None:
            out.append(int(span_track[i]))
            continue
        index = first_of_tid.get(rec.tid)
        if index is None:
            index = first_of_tid[rec.tid] = len(tracks)
            tracks.append(Track(index, rec.tid))
            _name_tracks(tracks)
        out.append(index)
    args = [_instant_args(rec) for rec in recs]
    ts = np.fromiter((r.ts for r in recs), np.float64, len(recs))
    return InstantColumns(whole_us(ts), np.asarray(out, np.int64), names([r.name for r in recs]), args)


def _instant_args(rec: Instant) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if rec.step is not None:
        args[schema.STEP] = rec.step
    if rec.attrs:
        args.update(rec.attrs)
    return args


_NUMBERS = frozenset({int, float, bool})


def scalar_values(rec: Scalar) -> list[tuple[str, float | int]]:
    """The numeric, finite values of a scalar record (bools as 0/1, integers beyond float range
    skipped); anything else is skipped."""
    out = []
    for key, value in (rec.values or {}).items():
        if type(value) in _NUMBERS:
            try:
                if math.isfinite(value):
                    out.append((str(key), int(value) if type(value) is bool else value))
            except OverflowError:
                continue
    return out


def _counter_columns(scalars: list[Scalar]) -> tuple[CounterColumns, list[str]]:
    """Every numeric, finite value of every scalar record (the rule of :func:`scalar_values`), as columns."""
    recs = [r for r in scalars if r.values]
    dicts = [r.values for r in recs]
    keys = [k for d in dicts for k in d]
    values = [v for d in dicts for v in d.values()]
    ts = np.repeat(np.fromiter((r.ts for r in recs), np.float64, len(recs)), list(map(len, dicts)))
    kinds = [type(v) for v in values]
    try:
        numeric = np.fromiter((k in _NUMBERS for k in kinds), bool, len(kinds))
        floats = np.array([v if k in _NUMBERS else 0.0 for v, k in zip(values, kinds)], np.float64)
    except OverflowError:  # an integer beyond float range: the rule, value by value
        pairs = [(r.ts, k, v) for r in recs for k, v in scalar_values(r)]
        ts = np.array([p[0] for p in pairs], np.float64)
        keys, values, kinds = [p[1] for p in pairs], [p[2] for p in pairs], [type(p[2]) for p in pairs]
        numeric = np.ones(len(pairs), bool)
        floats = np.array(values, np.float64)
    keep = numeric & np.isfinite(floats)
    integral = np.fromiter((k is not float for k in kinds), bool, len(kinds))[keep]
    if not keep.all():
        keys = [k for k, ok in zip(keys, keep.tolist()) if ok]
    codes = Codes()
    key = codes([str(k) for k in keys])
    return CounterColumns(whole_us(ts[keep]), key, floats[keep], integral), codes.values
