"""What an export draws across processes for communication (docs/export.md, "Communication").

Each writer renders one process at a time, but a collective spans its group's ranks: before the
processes are rendered, :func:`comm_plan` reads every process's ``comm.*`` records (only the lines
that hold them: a byte search, then the span model), adds the ops of Flight Recorder dumps, builds the
comm graph (:func:`otel_train.analysis.comm.build_graphs`: the one copy of the matching rules) and
turns it into marks per process:

* a **flow** per collective, through its members' spans in arrival order (first member: flow out;
  middle: in and out; last: in), and one per send -> recv pair;
* **last arrival**: the member that arrived last at a collective every member reached
  (:meth:`CommGraph.arrivals`);
* a **culprit** instant on the comm track of the rank a hang waits for
  (:func:`otel_train.analysis.comm.wait_chains`) and of the minority side of a desync
  (:meth:`CommGraph.desync_sides`);
* the ops only a dump saw, as spans of their own (``source: flight_recorder``).

Flow ids are numbered here, so they are unique in the trace.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from otel_train import schema
from otel_train.analysis.export.layout import COMM_TID
from otel_train.analysis.comm import SOURCE_FR, CommGraph, CommOp
from otel_train.analysis.clock import Clock
from otel_train.analysis.flight_recorder import FlightRecorderDumps, read_dumps
from otel_train.analysis.records import BadLines, Head, Instant, ProcessFiles, Warn, decode_chunk, open_regular
from otel_train.analysis.findings import CRASH, DESYNC, HANG, findings
from otel_train.analysis.spans import ProcessState, Run, Span, load_run, process_order
from otel_train.analysis.summary import default_fr

NEEDLES = (b'"comm.', b'"' + schema.INSTANT_MESH.encode() + b'"', b'"' + schema.INSTANT_PROCESS_START.encode() + b'"')
"""A line holding one of these may be a comm record (a ``comm.*`` span, a ``comm.group`` instant, a
mesh) or the ``process_start`` whose settings name the run's ``fr_dir``."""
CULPRIT = "culprit"
"""Name of the instant that marks a hang's or a desync's culprit on its comm track."""
LAST_ARRIVAL = "last_arrival"
CULPRIT_KINDS = (HANG, CRASH, DESYNC)
FR_SPAN_PREFIX = "fr:"
_BLOCK = 4 << 20

Key = tuple[str, int, int]  # (source, rank, attempt)


@dataclass(frozen=True, slots=True)
class SpanMark:
    """What one ``comm.*`` span carries beyond its record: its flow and whether it arrived last."""

    flow: int = 0  # 0: none
    flow_in: bool = False
    flow_out: bool = False
    last_arrival: bool = False


@dataclass(slots=True)
class ProcessMarks:
    """One process's marks: per span id, the spans only a dump saw, the culprit instants."""

    spans: dict[str, SpanMark] = field(default_factory=dict)
    extra_spans: list[Span] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)


@dataclass(slots=True)
class CommPlan:
    """Marks per (source, rank, attempt), and counts: flows (arrows drawn) and the dumps read."""

    marks: dict[Key, ProcessMarks] = field(default_factory=dict)
    flows: int = 0
    dumps: FlightRecorderDumps | None = None
    clock: Clock | None = None  # the hosts' clocks the export aligns to (docs/clock.md)

    def of(self, source: str, rank: int, attempt: int) -> ProcessMarks | None:
        return self.marks.get((source, rank, attempt))


def comm_plan(path: str | Path, order: list[tuple[ProcessFiles, int, Head | None]], fr: Path | None,
              warn: Warn, align: bool = True, *, run: Run | None = None, load: Callable[[], Run] | None = None
              ) -> CommPlan:
    """The marks of the processes in ``order`` (the exported ones:
    :func:`~otel_train.analysis.spans.process_order`), from the comm records of every process of the run
    at ``path`` (or the states of ``run``: a step window's, the read cache's) and the Flight Recorder
    dumps under ``fr`` (default: the run's ``fr_dir``), and the hosts' clocks (``align``: estimated from
    those records; else raw). ``load``: the run whose findings name the culprits (default: all of it)."""
    if run is None:
        everyone = process_order(path, warn=_quiet)
        run = Run([s for s in (scan_comm(pf, attempt, meta) for pf, attempt, meta in everyone) if s.records])
    run.align = align
    plan = CommPlan()
    fr = fr if fr is not None else default_fr(path, run)
    if fr.exists():
        known = [g for s in run.processes for g in s.comm_groups.values()]
        world = max((s.world_size or 0 for s in run.processes), default=0) or None
        plan.dumps = read_dumps(fr, warn=warn, world_size=world, groups=known)
        run.extra_ops, run.extra_groups = list(plan.dumps.ops), list(plan.dumps.groups.values())
    exported = {(pf.source, pf.rank, attempt) for pf, attempt, _ in order}
    ids = itertools.count(1)
    for graph in run.comm.values():
        _mark_graph(plan, graph, ids, exported)
        plan.clock = graph.clock
    if any(g.desynced or any(op.waiting for op in g.all_ops()) for g in run.comm.values()):
        _mark_culprits(plan, path, run, exported, load)
    return plan


def _quiet(_message: str) -> None:
    pass


def scan_comm(pf: ProcessFiles, attempt: int, meta: Head | None) -> ProcessState:
    """A process's comm records only (``keep=False``): the lines holding a :data:`NEEDLES` string, fed
    to the span model (bad lines are the full read's to count and report)."""
    state = ProcessState.of(pf, attempt, meta=meta)
    bad = BadLines(collect=True)
    for path in pf.paths:
        for data in _comm_lines(path):
            state.feed(decode_chunk(data, path, lambda: 0, bad))
    return state


def _comm_lines(path: Path) -> Iterator[bytes]:
    """The lines of ``path`` that may be comm records, a block at a time."""
    try:
        f = open_regular(path)
    except OSError:
        return
    with f:
        carry = b""
        while True:
            try:
                block = f.read(_BLOCK)
            except OSError:
                return
            data = carry + block if carry else block
            if not block:
                cut = len(data)
            else:
                cut = data.rfind(b"\n") + 1
            whole, carry = data[:cut], data[cut:]
            lines = _matching(whole)
            if lines:
                yield lines
            if not block:
                return


def _matching(data: bytes) -> bytes:
    found: list[tuple[int, int]] = []
    for needle in NEEDLES:
        at = data.find(needle)
        while at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end + 1
            found.append((start, end))
            at = data.find(needle, end)
    if not found:
        return b""
    found = sorted(set(found))
    return b"".join(data[a:b] for a, b in found)


# ---------------------------------------------------------------------------------------------
# Marks from the graph


def _mark_graph(plan: CommPlan, graph: CommGraph, ids: Iterator[int], exported: set[Key]) -> None:
    def marks(rank: int) -> ProcessMarks | None:
        key = (graph.source, rank, graph.attempt)
        if key not in exported:
            return None
        return plan.marks.setdefault(key, ProcessMarks())

    for op in graph.all_ops():
        if op.source == SOURCE_FR and op.span_id is None and (pm := marks(op.rank)) is not None:
            pm.extra_spans.append(dump_span(op))
    for members in graph.collectives.values():
        _chain(plan, [o for o in members.values() if marks(o.rank) is not None], ids, marks, graph.at)
    for send, recv in graph.p2p.values():
        if send is not None and recv is not None and marks(send.rank) and marks(recv.rank):
            _chain(plan, [send, recv], ids, marks, graph.at)
    for arrival in graph.arrivals():
        op = graph.collectives[(arrival.group, arrival.seq)][arrival.last]
        pm = marks(op.rank)
        if pm is not None:
            sid = span_id_of(op)
            pm.spans[sid] = _replace(pm.spans.get(sid, SpanMark()), last_arrival=True)


def _chain(plan: CommPlan, ops: list[CommOp], ids: Iterator[int], marks, at) -> None:
    """One flow through ``ops`` in the order a trace processor reads them (whole µs of the exported,
    aligned start ``at(op)``, then process order, which is rank order within a graph): out of the
    first, through the middle, into the last. A flow only goes forward in that order, so a recv
    posted before its send is the flow's start."""
    ops = sorted((o for o in ops if o.start is not None), key=lambda o: (math.floor(at(o) * 1e6 + 0.5), o.rank))
    if len(ops) < 2:
        return
    flow = next(ids)
    plan.flows += len(ops) - 1
    for i, op in enumerate(ops):
        pm = marks(op.rank)
        sid = span_id_of(op)
        old = pm.spans.get(sid, SpanMark())
        pm.spans[sid] = SpanMark(flow, i > 0, i < len(ops) - 1, old.last_arrival)


def _replace(mark: SpanMark, **changes: bool) -> SpanMark:
    values = {"flow": mark.flow, "flow_in": mark.flow_in, "flow_out": mark.flow_out, "last_arrival": mark.last_arrival}
    values.update(changes)
    return SpanMark(**values)


def span_id_of(op: CommOp) -> str:
    """The op's span id: the trace's, or for an op only a dump saw one made from its identity."""
    if op.span_id:
        return op.span_id
    peer = "" if op.peer is None else f":{op.peer}"
    return f"{FR_SPAN_PREFIX}{op.group}:{op.seq}:{op.op}{peer}"


def dump_span(op: CommOp) -> Span:
    """An op only a Flight Recorder dump saw, as a span (open while the rank waits in it)."""
    attrs: dict = {schema.ATTR_COMM_GROUP: op.group, schema.ATTR_COMM_SEQ: op.seq, "source": SOURCE_FR,
                   "state": op.state}
    for key, value in ((schema.ATTR_COMM_PEER, op.peer), (schema.ATTR_COMM_BYTES, op.nbytes),
                       (schema.ATTR_COMM_DTYPE, op.dtype)):
        if value is not None:
            attrs[key] = value
    status = "open" if op.waiting else schema.STATUS_OK
    end = None if op.waiting else (op.end if op.end is not None else op.start)
    return Span(schema.comm_span_name(op.op), span_id_of(op), None, None, op.start or 0.0, end, status, op.tid,
                op.step, attrs)


def _mark_culprits(plan: CommPlan, path: str | Path, scanned: Run, exported: set[Key],
                   load: Callable[[], Run] | None = None) -> None:
    """A ``culprit`` instant on the comm track of each culprit of the findings' communication hangs and
    desyncs (the one findings module, on the whole run read once more: only a run whose comm graph has
    a rank waiting or a desync pays for it), at the first waiter's arrival (a desync: its own op)."""
    run = load() if load is not None else load_run(path, warn=_quiet)
    run.extra_ops, run.extra_groups, run.align = scanned.extra_ops, scanned.extra_groups, scanned.align
    source_of = {(d.rank, d.attempt): d.source for d in run.processes}
    for found in findings(run, stragglers=False):
        comm = found.get("comm")
        if found.get("kind") not in CULPRIT_KINDS or not isinstance(comm, dict):
            continue
        attempt = found.get("attempt") or 0
        culprits = found.get("ranks") if found.get("kind") == DESYNC else None
        for rank in culprits or [found.get("rank")]:
            key = (source_of.get((rank, attempt), ""), rank, attempt)
            graph = run.comm.get((key[0], attempt))
            if key not in exported or graph is None:
                continue
            attrs = {"kind": found["kind"], "message": found.get("message", ""), **comm}
            plan.marks.setdefault(key, ProcessMarks()).instants.append(_instant(_mark_ts(graph, comm, rank), attrs))


def _mark_ts(graph: CommGraph, comm: dict, rank: int) -> float | None:
    """When to mark, on the culprit's own clock (the export aligns it with the rest of its process):
    a desync at the culprit's op, a hang when the first waiter arrived (on the reference clock)."""
    group, seq = comm.get("group"), comm.get("seq")
    ops = [op for op in graph.all_ops() if op.group == group and op.seq == seq and op.start is not None]
    own = [op.start for op in ops if op.rank == rank]
    if comm.get("op") and own and rank not in comm.get("waiting", ()) and rank not in comm.get("missing", ()):
        return min(own)  # type: ignore[type-var]
    waiting = [graph.at(op) for op in ops if op.rank in comm.get("waiting", ())]
    if waiting and graph.clock is not None:
        return graph.clock.to_host(graph.hosts.get(rank), min(waiting))  # type: ignore[type-var]
    return min(waiting or own or [None], key=lambda t: t or 0.0)  # type: ignore[type-var]


def _instant(ts: float | None, attrs: dict) -> Instant:
    return Instant(v=schema.SCHEMA_VERSION, ts=ts or 0.0, name=CULPRIT, attrs=attrs, tid=COMM_TID)  # type: ignore[arg-type]

