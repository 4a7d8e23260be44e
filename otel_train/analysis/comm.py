"""The communication graph: every rank's ``comm.*`` ops, matched across ranks (docs/comm.md).

* a collective is one op of one process group: the members' ops with the same ``comm.group`` and
  ``comm.seq`` are the same collective;
* a p2p op is matched by its pair and number: the k-th send from A to B is the k-th recv on B from A
  (both carry ``comm.seq`` = k);
* an op's start is when its rank arrived (issued it); its end is when it finished for that rank;
  an op without an end is a rank waiting in it (open);
* ops come from the trace files (``comm.*`` spans, kept by the span model:
  :meth:`~otel_train.analysis.spans.ProcessState.comm_ops`) and from Flight Recorder dumps; an op
  both sources saw is one op (the trace's times win, the dump fills what the trace lacks);
* the groups and their members come from the ``comm.group`` instants (or a dump's ``pg_config``);
  the mesh from ``otel_train.mesh`` instants.

One :class:`CommGraph` holds one attempt of one source (sequence numbers start again in every
attempt): :func:`build_graphs` makes them all, :func:`build_graph` one. A graph is built by adding ops
one at a time (:meth:`CommGraph.add`), so live ``watch`` keeps one and adds what each poll read.
The questions the findings ask (docs/comm.md "Findings") are answered here: who never issued the op
a rank waits in (:meth:`CommGraph.blockers`, :func:`wait_chains`), where members disagree
(:meth:`CommGraph.desync_sides`) and who arrived last (:meth:`CommGraph.arrivals`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from otel_train import schema
from otel_train.analysis.clock import Clock, estimate, raw_clock

if TYPE_CHECKING:
    from otel_train.analysis.spans import Run

SOURCE_TRACE = "trace"
SOURCE_FR = "flight_recorder"
DUMP_SOURCE = "training"  # the source a dump's ops count as when no trace file of their attempt exists
STATE_COMPLETED = "completed"  # Flight Recorder: the op finished

SIZED_OPS = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv"})
"""Ops whose members must pass the same number of bytes (gather, scatter and all_to_all may not)."""


@dataclass(frozen=True, slots=True)
class CommOp:
    """One rank's view of one communication op.

    ``start``/``end`` are the rank's own (host) clock in Unix seconds; ``end`` is None while the rank
    waits in it. ``peer`` is the other side's global rank for send/recv, else None. ``span_id`` is
    the trace span's id (None for an op only a dump saw). ``state`` is Flight Recorder's
    (``scheduled``, ``started``, ``completed``) or ``ok``/``error``/``open``/``incomplete`` from the trace.
    ``phase`` is the last phase the rank closed before it issued the op (trace only).
    """

    rank: int
    attempt: int
    group: str
    seq: int
    op: str
    start: float | None
    end: float | None = None
    peer: int | None = None
    nbytes: int | None = None
    dtype: str | None = None
    step: int | None = None
    span_id: str | None = None
    tid: int | None = None
    state: str = "ok"
    source: str = SOURCE_TRACE
    clock: str = "host"
    phase: str | None = None

    @property
    def waiting(self) -> bool:
        """Still inside the op (no end, and no dump says it completed): the rank waits in it."""
        return self.end is None and self.state != STATE_COMPLETED

    @property
    def p2p(self) -> bool:
        """A send or a recv (matched by pair and number, not by group)."""
        return self.op in schema.P2P_OPS and self.peer is not None

    @property
    def pair(self) -> tuple[int, int, int]:
        """(src, dst, seq) of a send or recv."""
        assert self.peer is not None
        return (self.rank, self.peer, self.seq) if self.op == "send" else (self.peer, self.rank, self.seq)

    def signature(self) -> tuple[str, int | None, str | None]:
        """What members of one collective must agree on: the op, its bytes (for sized ops), its dtype."""
        return (self.op, self.nbytes if self.op in SIZED_OPS else None, self.dtype)

    def describe(self) -> str:
        """``all_reduce 16 B float32`` (what is known of it)."""
        parts = [self.op]
        if self.nbytes is not None:
            parts.append(f"{self.nbytes} B")
        if self.dtype is not None:
            parts.append(self.dtype)
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Group:
    """A process group: its id, what it is for (``default_pg``, ``dp``, ``pp``, ``tp``) and its members'
    global ranks in group order."""

    group: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One collective seen from one host: who arrived last, by how much, and what the others waited."""

    group: str
    seq: int
    op: str
    last: int  # the rank that arrived last
    gap_ms: float  # last arrival minus the second-to-last
    waited_ms: float  # sum over the other members of (last arrival - own arrival)
    members: tuple[int, ...]  # the members compared (one host's), ascending
    step: int | None
    start: float  # the last arrival (on the reference clock when the graph's clock is estimated)


@dataclass(slots=True)
class CommGraph:
    """Every op of a run, matched: ``collectives[(group, seq)]`` holds each member's op (by rank);
    ``p2p[(src, dst, seq)]`` the send (``[0]``) and the recv (``[1]``), either None when unseen.

    ``world`` is the world size (members of a group that no ``comm.group`` instant described),
    ``hosts`` each rank's host; ``clock`` the hosts' clocks (docs/clock.md): arrival times of ranks on
    different hosts are compared on the reference clock, and not at all for a host it could not
    estimate (without a clock, only within one host).
    """

    groups: dict[str, Group] = field(default_factory=dict)
    collectives: dict[tuple[str, int], dict[int, CommOp]] = field(default_factory=dict)
    p2p: dict[tuple[int, int, int], list[CommOp | None]] = field(default_factory=dict)
    mesh: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)  # rank -> dim -> (size, index)
    source: str = "training"
    attempt: int = 0
    world: int = 0
    hosts: dict[int, str | None] = field(default_factory=dict)
    last_seq: dict[tuple[int, str], int] = field(default_factory=dict)  # (rank, group) -> highest seq issued
    last_p2p: dict[tuple[int, int, str], int] = field(default_factory=dict)  # (rank, peer, op) -> highest seq
    desynced: dict[str, int] = field(default_factory=dict)  # group -> first seq whose members disagree
    ops: int = 0
    clock: Clock | None = None

    # -- building ------------------------------------------------------------------------------

    def add(self, op: CommOp) -> None:
        """Add one op (a later view of the same op replaces an earlier one; a dump's op merges into
        the trace's)."""
        self.ops += 1
        if op.p2p:
            slots = self.p2p.setdefault(op.pair, [None, None])
            i = 0 if op.op == "send" else 1
            slots[i] = merge(slots[i], op)
            key = (op.rank, op.peer, op.op)  # type: ignore[assignment]
            if op.seq > self.last_p2p.get(key, -1):  # type: ignore[arg-type]
                self.last_p2p[key] = op.seq  # type: ignore[index]
            if slots[0] is not None and slots[1] is not None and _disagree(slots[0], slots[1]):
                self._desync(op.group, op.seq)
            return
        ops = self.collectives.setdefault((op.group, op.seq), {})
        ops[op.rank] = merge(ops.get(op.rank), op)
        key2 = (op.rank, op.group)
        if op.seq > self.last_seq.get(key2, -1):
            self.last_seq[key2] = op.seq
        if len(ops) > 1 and op.seq < self.desynced.get(op.group, op.seq + 1):
            # Against one other member: each op was checked against the same one when it came.
            ref = next(other for rank, other in ops.items() if rank != op.rank)
            if _disagree(ops[op.rank], ref):
                self._desync(op.group, op.seq)

    def _desync(self, group: str, seq: int) -> None:
        if seq < self.desynced.get(group, seq + 1):
            self.desynced[group] = seq

    def add_group(self, group: Group, *, replace: bool = True) -> None:
        """A ``comm.group`` instant (or a dump's ``pg_config``); the trace's wins over a dump's."""
        if replace or group.group not in self.groups:
            self.groups[group.group] = group

    # -- questions -----------------------------------------------------------------------------

    def members(self, group: str) -> tuple[int, ...]:
        """The group's global ranks: from its ``comm.group`` instant (or a dump's ``pg_config``), else
        the whole world."""
        known = self.groups.get(group)
        return known.ranks if known is not None and known.ranks else tuple(range(self.world))

    def desc(self, group: str) -> str | None:
        """What the group is for (``dp``, ``pp``, ...), when a ``comm.group`` instant said."""
        known = self.groups.get(group)
        return known.desc if known is not None and known.desc else None

    def issued(self, rank: int, group: str, seq: int) -> bool:
        """Whether ``rank`` issued collective ``seq`` of ``group`` (or a later one of that group)."""
        return rank in self.collectives.get((group, seq), ()) or self.last_seq.get((rank, group), -1) >= seq

    def counterpart(self, op: CommOp) -> CommOp | None:
        """The other side of a send or recv, when seen."""
        slots = self.p2p.get(op.pair)
        return None if slots is None else slots[1 if op.op == "send" else 0]

    def blockers(self, op: CommOp) -> list[int]:
        """The ranks that never issued their part of ``op``: the members missing from a collective,
        the peer of a send (recv) that never issued the matching recv (send)."""
        if op.p2p:
            other = "recv" if op.op == "send" else "send"
            peer = op.peer
            assert peer is not None
            if self.counterpart(op) is not None or self.last_p2p.get((peer, op.rank, other), -1) >= op.seq:
                return []
            return [peer]
        absent = [m for m in self.members(op.group) if m != op.rank and not self.issued(m, op.group, op.seq)]
        # A member the graph knows nothing of in this group (its dump is missing, its file holds no op)
        # is unknown, not proven absent: the ranks seen issuing the group's ops before are blamed first.
        seen = [m for m in absent if (m, op.group) in self.last_seq]
        return seen or absent

    def waiting(self, ranks: Iterable[int] | None = None) -> dict[int, list[CommOp]]:
        """Rank -> the ops it waits in (of ``ranks``, when given), earliest first. An op left open
        whose other side completed (an async op never waited for: an ``isend`` whose recv finished)
        is done, not waited in."""
        wanted = None if ranks is None else set(ranks)
        out: dict[int, list[CommOp]] = {}
        for op in self.all_ops():
            if op.waiting and (wanted is None or op.rank in wanted) and not self._done_elsewhere(op):
                out.setdefault(op.rank, []).append(op)
        for ops in out.values():
            ops.sort(key=lambda o: o.start or 0.0)
        return out

    def _done_elsewhere(self, op: CommOp) -> bool:
        others = [self.counterpart(op)] if op.p2p else [o for r, o in self.collectives.get((op.group, op.seq), {}).items()
                                                        if r != op.rank]
        return any(o is not None and not o.waiting and o.state not in (schema.STATUS_ERROR, schema.STATUS_INCOMPLETE)
                   for o in others)

    def all_ops(self) -> Iterator[CommOp]:
        """Every op, collectives first."""
        for ops in self.collectives.values():
            yield from ops.values()
        for pair in self.p2p.values():
            yield from (op for op in pair if op is not None)

    def desync_sides(self, group: str) -> tuple[int, dict[tuple[Any, ...], list[int]]] | None:
        """The group's first seq whose members disagree, and each side: signature -> ranks."""
        seq = self.desynced.get(group)
        if seq is None:
            return None
        ops = self.collectives.get((group, seq))
        if ops is None:  # a p2p pair: the send and the recv of one number disagree
            ops = {op.rank: op for pair in self.p2p.values() for op in pair
                   if op is not None and op.group == group and op.seq == seq}
        sides: dict[tuple[Any, ...], list[int]] = {}
        for rank in sorted(ops):
            sides.setdefault(ops[rank].signature()[:1] if ops[rank].p2p else ops[rank].signature(), []).append(rank)
        if len(sides) < 2:  # p2p: op names differ by nature; compare size and dtype only
            sides = {}
            for rank in sorted(ops):
                sides.setdefault(ops[rank].signature()[1:], []).append(rank)
        return seq, sides

    def minority(self, group: str) -> tuple[int, list[int], dict[tuple[Any, ...], list[int]]] | None:
        """The group's first desynced seq, its culprit side (the ranks a ``desync`` finding names) and
        every side: fewest ranks; at a tie the signature the group issued least often elsewhere; then
        the side without the lowest rank."""
        found = self.desync_sides(group)
        if found is None or len(found[1]) < 2:
            return None
        seq, sides = found

        def seen(sig: tuple[Any, ...]) -> int:
            return sum(1 for (g, _), ops in self.collectives.items() if g == group
                       for op in ops.values() if op.signature() == sig)

        culprit = min(sides, key=lambda sig: (len(sides[sig]), seen(sig), -min(sides[sig])))
        return seq, sides[culprit], sides

    def at(self, op: CommOp) -> float | None:
        """When ``op``'s rank arrived, on the reference clock (its own clock without an estimate)."""
        return op.start if self.clock is None else self.clock.align(self.hosts.get(op.rank), op.start)

    def arrivals(self) -> Iterator[Arrival]:
        """Every collective that each member arrived at, per clock domain (docs/clock.md): all members on
        the reference clock when the clock is estimated, else per host."""
        clock = self.clock
        for (group, seq), ops in self.collectives.items():
            members = self.members(group)
            if len(members) < 2 or any(m not in ops or ops[m].start is None for m in members):
                continue
            by_host: dict[str | None, list[tuple[float, CommOp]]] = {}
            for m in members:
                host = self.hosts.get(m)
                t = ops[m].start if clock is None else clock.align(host, ops[m].start)
                by_host.setdefault(host if clock is None else clock.domain(host), []).append((t, ops[m]))  # type: ignore[arg-type]
            for same in by_host.values():
                if len(same) < 2:
                    continue
                same.sort(key=lambda to: to[0])
                (t, last), (t2, _) = same[-1], same[-2]
                waited = sum(t - u for u, _ in same[:-1]) * 1000.0
                yield Arrival(group, seq, last.op, last.rank, (t - t2) * 1000.0, waited,
                              tuple(sorted(o.rank for _, o in same)), last.step, t)

    def recent(self, first_step: int, older: int = 1000) -> CommGraph:
        """A copy holding the collectives and p2p ops of steps from ``first_step`` on (live ``watch``'s
        straggler ask over its recent steps): newest first, until ``older`` in a row are older."""
        out = CommGraph(dict(self.groups), {}, {}, dict(self.mesh), self.source, self.attempt, self.world,
                        dict(self.hosts), dict(self.last_seq), dict(self.last_p2p), dict(self.desynced), clock=self.clock)
        for table, copy in ((self.collectives, dict), (self.p2p, list)):
            taken, behind = [], 0
            for key in reversed(table):  # type: ignore[call-overload]
                value = table[key]  # type: ignore[index]
                ops = value.values() if isinstance(value, dict) else [o for o in value if o is not None]
                if all(o.step is not None and o.step < first_step for o in ops):
                    behind += 1
                    if behind >= older:
                        break
                    continue
                behind = 0
                taken.append((key, copy(value)))
            target = out.collectives if table is self.collectives else out.p2p
            for key, value in reversed(taken):
                target[key] = value  # type: ignore[index]
        out.ops = sum(len(v) for v in out.collectives.values()) + len(out.p2p)
        return out

    def prune(self, before_step: int) -> int:
        """Drop the collectives and p2p pairs of steps before ``before_step`` that every side has left
        (what live ``watch`` needs no more: who issued what stays in ``last_seq``/``last_p2p``, a
        group's first desynced seq stays); returns how many were dropped."""
        def done(ops: Iterable[CommOp | None]) -> bool:
            return all(o is not None and o.end is not None and o.step is not None and o.step < before_step for o in ops)

        keep = {(g, seq) for g, seq in self.desynced.items()}
        old = [k for k, ops in self.collectives.items()
               if k not in keep and len(ops) >= len(self.members(k[0])) and done(ops.values())]
        for k in old:
            del self.collectives[k]
        pairs = [k for k, pair in self.p2p.items() if done(pair)]
        for k in pairs:
            del self.p2p[k]
        return len(old) + len(pairs)

    def stage(self, rank: int) -> int | None:
        """The rank's pipeline stage (its ``pp`` coordinate), when a mesh said."""
        dims = self.mesh.get(rank, {})
        return dims["pp"][1] if "pp" in dims else None


def _disagree(a: CommOp, b: CommOp) -> bool:
    if a.p2p and b.p2p:  # a send and its recv: the same bytes and dtype
        return (a.nbytes is not None and b.nbytes is not None and a.nbytes != b.nbytes) or (
            a.dtype is not None and b.dtype is not None and a.dtype != b.dtype)
    sa, sb = a.signature(), b.signature()
    return any(x is not None and y is not None and x != y for x, y in zip(sa, sb))


def merge(old: CommOp | None, new: CommOp) -> CommOp:
    """One op seen twice: the trace's times win, a dump fills what the trace lacks (its state too);
    of two views from the trace the later (an open op that closed since) wins."""
    if old is None:
        return new
    if (old.source == SOURCE_FR) == (new.source == SOURCE_FR):
        return new if new.end is not None or old.end is None else old
    trace, dump = (new, old) if old.source == SOURCE_FR else (old, new)
    fill = {name: getattr(dump, name) for name in ("nbytes", "dtype", "step", "peer")
            if getattr(trace, name) is None and getattr(dump, name) is not None}
    if trace.state not in (schema.STATUS_ERROR, schema.STATUS_INCOMPLETE):
        fill["state"] = dump.state
    return dataclasses.replace(trace, **fill) if fill else trace


# ---------------------------------------------------------------------------------------------
# Whole runs


def build_graphs(run: Run, extra_ops: Iterable[CommOp] | None = None, extra_groups: Iterable[Group] | None = None
                 ) -> dict[tuple[str, int], CommGraph]:
    """The graph of each (source, attempt) of ``run``: its processes' ``comm.*`` ops, groups and mesh,
    with ``extra_ops``/``extra_groups`` (read from Flight Recorder dumps; default: the run's own
    ``extra_ops``/``extra_groups``) merged in by attempt."""
    extra_ops = run.extra_ops if extra_ops is None else extra_ops
    extra_groups = run.extra_groups if extra_groups is None else extra_groups
    graphs: dict[tuple[str, int], CommGraph] = {}
    for d in run.processes:
        graph = graphs.get((d.source, d.attempt))
        if graph is None:
            graph = graphs[(d.source, d.attempt)] = CommGraph(source=d.source, attempt=d.attempt)
        feed_process(graph, d)
    extras = list(extra_ops)
    for op in extras:
        graph = next((g for g in graphs.values() if g.attempt == op.attempt), None)
        if graph is None:  # a dump of an attempt that wrote no trace
            graph = graphs[(DUMP_SOURCE, op.attempt)] = CommGraph(source=DUMP_SOURCE, attempt=op.attempt)
        graph.add(op)
        graph.world = max(graph.world, op.rank + 1)
    for group in extra_groups:
        for graph in graphs.values():
            graph.add_group(group, replace=False)
    clock = run_clock(run, graphs)
    for graph in graphs.values():
        graph.clock = clock
    return graphs


def run_clock(run: Run, graphs: dict[tuple[str, int], CommGraph]) -> Clock:
    """The hosts' clocks of ``run`` from all its graphs (docs/clock.md); raw with ``run.align`` off.
    ``t0`` is the reference host's first record."""
    if not getattr(run, "align", True):
        return raw_clock()
    if len({d.host for d in run.processes}) < 2 and len({h for g in graphs.values() for h in g.hosts.values()}) < 2:
        return Clock(reference=next((d.host for d in run.processes), None))
    first = min(run.processes, key=lambda d: d.rank, default=None)
    starts = [d.first_ts for d in run.processes if first is not None and d.host == first.host and d.first_ts]
    return estimate(graphs.values(), min(starts) if starts else None)


def feed_process(graph: CommGraph, d: Any, since: int = 0) -> int:
    """Add what the process state ``d`` knows (its groups, mesh, the ops it closed from index ``since``
    on and every op it waits in); returns the index to pass next time (live ``watch`` adds as it reads)."""
    for group in d.comm_groups.values():
        graph.add_group(group)
    if d.mesh:
        graph.mesh[d.rank] = d.mesh
    graph.world = max(graph.world, d.world_size or 0, d.rank + 1)
    graph.hosts[d.rank] = d.host
    ops, done = d.comm_ops(since)
    for op in ops:
        graph.add(op)
    return done


def build_graph(run: Run, extra_ops: Iterable[CommOp] | None = None, extra_groups: Iterable[Group] | None = None, *,
                source: str | None = None, attempt: int | None = None) -> CommGraph:
    """The graph of one (source, attempt) of ``run`` (default: the latest attempt of the first source;
    an empty graph for a run without comm ops). See :func:`build_graphs` for all of them."""
    graphs = build_graphs(run, extra_ops, extra_groups)
    keys = sorted(k for k in graphs if (source is None or k[0] == source) and (attempt is None or k[1] == attempt))
    if not keys:
        return CommGraph(source=source or "training", attempt=attempt or 0)
    first = keys[0][0]
    return graphs[max(k for k in keys if k[0] == first)]


def wait_chains(graph: CommGraph, waits: dict[int, list[CommOp]]) -> dict[int, list[tuple[int, CommOp]]]:
    """Follow who waits for whom: culprit rank -> the links ``(waiter, op)`` that lead to it.

    A rank waiting in an op waits for that op's :meth:`~CommGraph.blockers`; a blocker that itself
    waits in communication passes the wait on; the chain ends at a rank that is not waiting in any
    op (it stopped elsewhere, ended, died, or wrote nothing): that one is the culprit. Ranks that
    wait for each other (a cycle: one skipped an op the others wait in, went on, and waits in a
    later one they never reach) name the one that went furthest: the rank whose waiting op is at
    the highest step, when exactly one is; none when they are level (a schedule that deadlocks).
    """
    direct: dict[int, list[tuple[int, CommOp]]] = {}  # blocker -> (waiter, op) links
    for rank, ops in waits.items():
        for op in ops:
            for b in graph.blockers(op):
                direct.setdefault(b, []).append((rank, op))
    culprits = {b: _links_to(b, direct) for b in direct if b not in waits}
    reached = set(culprits) | {w for links in culprits.values() for w, _ in links}
    cycle = {r: max(-1 if op.step is None else op.step for op in waits[r]) for r in direct if r not in reached}
    if cycle:
        top = max(cycle.values())
        ahead = [r for r, step in cycle.items() if step == top]
        if len(ahead) == 1 and top > min(cycle.values()):
            culprits[ahead[0]] = _links_to(ahead[0], direct)
    return culprits


def _links_to(culprit: int, direct: dict[int, list[tuple[int, CommOp]]]) -> list[tuple[int, CommOp]]:
    """Every (waiter, op) link that leads to ``culprit``, directly or through other waiters."""
    links, seen, todo = [], {culprit}, [culprit]
    while todo:
        for waiter, op in direct.get(todo.pop(), []):
            if waiter == culprit:
                continue
            links.append((waiter, op))
            if waiter not in seen:
                seen.add(waiter)
                todo.append(waiter)
    return links


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0–4, 6, 7``: runs of three or more consecutive ranks as ranges."""
    values = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{values[i]}–{values[j]}")
        else:
            out.extend(str(v) for v in values[i:j + 1])
        i = j + 1
    return ", ".join(out)
