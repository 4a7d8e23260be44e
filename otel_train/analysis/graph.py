"""The dependency graph of a run, read from its records, and its simulation (docs/analysis.md "What-if").

**Ops.** On each rank the graph's ops are the non-overlapping cover of its spans: the *leaves* (spans
of a name no other non-``comm.*`` name has as its parent) cut by the rank's ``comm.*`` ops. Comm ops
that overlap in time on one rank stay concurrent: they form one *cluster* (an async bucket
all-reduce and the next one). A leaf cut by a cluster becomes *pieces* (``backward`` before and
after the all-reduce it holds), piece ``k`` of a leaf keyed ``(name, k)``; leaves that overlap
each other (another thread's spans) are serialised, the later one starting when the earlier ends.
Time no leaf covers is the *lead* of the next item (``(untraced)``), kept with that item.

**Edges.** An item follows the item before it on its rank: a piece ends ``lead + dur`` after it; a
cluster's ops arrive ``lead + offset`` after it (the offset: when the op started in its cluster) and
the cluster ends when its last op ends. A collective (matched by group and ``comm.seq``) is a *join*:
every member ends no earlier than the last member's arrival plus its own *transfer* time (measured:
its end minus the last arrival, on the aligned clock), nor before its own arrival. A send/recv pair
(matched by group, sender, receiver and ``comm.seq``) is a join of two whose recv alone waits: it ends
no earlier than the later of its own arrival and the send's *end*, plus its own transfer (measured:
its end minus that time, so one value whether it waited for the data or found it there; a detached
send's *arrival*: its end is when its rank waited for it). An eager send ends ``dur`` (as measured,
or typical) after its own arrival, never waiting for the recv (so two ranks that each send, then
receive, never wait for each other); a send that *waited* for its recv (gloo's and NCCL's block
until the receiver is there: it ended after the recv's arrival, and waited longer before it than it
took after) ends no earlier than the later of both arrivals plus its own transfer (its end minus
that time). An op whose other side is missing, or whose members sit in different steps, ends
``dur`` after its arrival.

**Blocks.** A step is a block: the ops tagged with it (its leaves' and comm ops' ``step``; a rank's
items never move back to an earlier step). Block ``b``'s time ``T[b]`` is the latest end of a rank's
last item in it; a step lasts ``T[b] - T[b-1]`` (the first block of the window only anchors). Each
rank's first item starts at its measured time; every later one is computed.

**Simulation** (:func:`simulate`): every edge weight is a sum of two terms, each owned by one
(rank, phase) and taken as measured or typical per scenario (a boolean mask over owners; the last
owner column is *fixed*: always measured). Nodes are visited level by level within a block (a level:
nodes whose inputs are all in earlier levels), all scenarios at once as numpy rows. With every
owner measured the simulation reproduces the measured times exactly (each edge is tight).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from otel_train.analysis.clock import Clock
from otel_train.analysis.graph_chain import Flat, chain, flatten, host_shift
from otel_train.analysis.graph_joins import Joins, Waits, joins, waits
from otel_train.analysis.graph_model import (
    ARRIVE, END, EXIT, JOIN, P2P_KEY, PIECE, RESOLUTION_MS, UNTRACED, Graph, Window, _dense, _medians, group_mean,
    unsynchronized,
)
from otel_train.analysis.graph_ops import Names, rank_ops
from otel_train.analysis.graph_sim import _all_levels, _levels, simulate, simulate_split, step_times
from otel_train.analysis.spans import ProcessState

__all__ = ["UNTRACED", "Graph", "build", "simulate", "simulate_split", "step_times", "unsynchronized",
           "_all_levels", "_levels"]

SYNC_DEFAULT = ("backward",)


def _edges(flat: Flat, jn: Joins, wt: Waits, P: int, fixed: int
           ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Edge columns [src, dst, own0, wm0, wi0, own1, wm1, wi1], node kinds, node blocks, and each
    item's node.

    Nodes: one per piece (its end) and per cluster of several ops (its exit), then each op's
    arrival, each op's end (a one-op cluster's item node), each join, each rendezvous, each wait. An op
    alone in its cluster has no arrival node: its edges leave the item before it, carrying the lead (its
    offset is 0). An item whose lead is a wait (``wt``) follows its wait node instead, with no lead: the
    wait node is the later of the item before it and the op end waited for (plus the measured ``delta``)."""
    ni, no, nj = flat.i_start.size, flat.o_start.size, jn.block.size
    nr = int((jn.rv_of >= 0).sum())
    arrive, end = ni + np.arange(no), ni + no + np.arange(no)
    item = np.arange(ni)
    o_item = flat.o_item
    det = flat.o_detached.astype(bool)
    single = (flat.i_piece < 0) & (np.bincount(o_item, minlength=ni) == 1) & (np.bincount(o_item, det, ni) == 0)
    alone = single[o_item]  # ops alone in their cluster (and not detached)
    node_of = item.copy()
    node_of[o_item[alone]] = end[alone]
    prev = flat.i_prev
    rank = flat.i_rank.astype(np.int64)
    same = (prev >= 0) & (flat.i_block[np.maximum(prev, 0)] == flat.i_block)
    from_ = np.where(same, node_of[np.maximum(prev, 0)], -1 - rank)  # the previous item, or the boundary
    lead = np.where(prev >= 0, flat.i_start - flat.i_end[np.maximum(prev, 0)], 0.0)
    wnode = ni + 2 * no + nj + nr + np.arange(wt.item.size)
    w = np.concatenate([np.zeros(wnode.size), wt.delta])  # the item before: no lead; the op end: + delta
    wait_edges = (np.concatenate([from_[wt.item], wt.node]), np.tile(wnode, 2), np.full(w.size, fixed), w, w,
                  *_fixed_zero(w.size, fixed)[3:])
    from_[wt.item], lead[wt.item] = wnode, 0.0
    waited = np.zeros(ni, bool)
    waited[wt.item] = True
    cols = _columns(flat, jn, P, fixed, Nodes(arrive, end, ni + 2 * no + np.arange(nj), from_, node_of, alone,
                                              ni + 2 * no + nj + np.arange(nr), waited), lead, rank)
    edges = [np.concatenate([c[k] for c in [*cols, wait_edges]]) for k in range(8)]
    kinds = np.concatenate([np.where(flat.i_piece >= 0, PIECE, EXIT), np.full(no, ARRIVE), np.full(no, END),
                            np.full(nj + nr + wnode.size, JOIN)])
    blocks = np.concatenate([flat.i_block, flat.i_block[o_item], flat.i_block[o_item], jn.block,
                             jn.block[jn.rv_of >= 0], flat.i_block[wt.item]])
    alive = np.ones(kinds.size, bool)
    alive[item[single]] = False  # a one-op cluster's node is its op's end
    alive[arrive[alone]] = False  # ... and its op's edges leave the item before it
    renum = np.cumsum(alive) - 1
    edges[0] = np.where(edges[0] >= 0, renum[np.maximum(edges[0], 0)], edges[0])
    edges[1] = renum[edges[1]]
    return edges, kinds[alive], blocks[alive], renum[node_of]


@dataclass(slots=True)
class Nodes:
    """Node ids of :func:`_edges`: per op its arrival and end, per join its node; per item the node
    its ops and pieces follow (``from_``, negative: the rank's boundary) and its own node."""

    arrive: np.ndarray
    end: np.ndarray
    join: np.ndarray
    from_: np.ndarray
    node_of: np.ndarray
    alone: np.ndarray
    rv: np.ndarray  # per rendezvous node (Joins.rv_of) its node
    waited: np.ndarray  # per item: its lead is a wait (it follows a wait node, with no lead)


def _columns(flat: Flat, jn: Joins, P: int, fixed: int, nd: Nodes, lead: np.ndarray, rank: np.ndarray
             ) -> list[tuple[np.ndarray, ...]]:
    """The edge columns of :func:`_edges`, by kind of edge."""
    o_item, al, na = flat.o_item, nd.alone, ~nd.alone
    ikey = flat.i_name * (int(flat.i_piece.max(initial=0)) + 2) + flat.i_piece + 1  # (name, piece), compact
    lead_i = _lead_ideal(ikey, lead, (flat.i_prev >= 0) & ~nd.waited)
    piece = flat.i_piece >= 0
    dur = flat.i_end - flat.i_start
    dur_i = np.zeros(dur.size)
    dur_i[piece] = group_mean(ikey[piece], dur[piece])
    det = flat.o_detached.astype(bool)
    o_dur, tr_i, du_i = _op_typicals(flat, jn, det)
    w, member, rv = jn.waits, jn.of >= 0, jn.rendezvous
    o_own = flat.o_rank.astype(np.int64) * P + flat.o_name
    d_m, d_i = np.where(w | rv, 0.0, o_dur), np.where(w | rv, 0.0, du_i)
    # a waiting op alone in its cluster: its end after its join never comes before its arrival
    # (the join is at least its arrival) unless a transfer is negative; only then the edge is kept
    direct = al & (~w | (jn.transfer < 0) | (tr_i < 0))
    off = flat.o_start - flat.i_start[o_item]
    untr, fi = rank * P, lambda n: np.full(n, fixed)
    lo, li, fr, un = lead[o_item], lead_i[o_item], nd.from_[o_item], untr[o_item]
    sent = flat.o_send & ~det
    via = member & (sent | na)  # join inputs from a node of the op: a send's end, else its arrival
    return [
        # pieces: lead (untraced) + dur (the piece's phase); clusters' exits get their ops' ends below
        (nd.from_[piece], np.flatnonzero(piece), untr[piece], lead[piece], lead_i[piece],
         rank[piece] * P + flat.i_name[piece], dur[piece], dur_i[piece]),
        # each op of a cluster of several arrives lead + offset after the item before its cluster
        (fr[na], nd.arrive[na], un[na], lo[na], li[na], fi(int(na.sum())), off[na], off[na]),
        # ... and ends no earlier than its arrival (+ its dur when it waits for no join)
        (nd.arrive[na], nd.end[na], o_own[na], d_m[na], d_i[na]) + _fixed_zero(int(na.sum()), fixed)[:3],
        # an op alone ends no earlier than lead + (its dur when it waits for no join) after the item before
        (fr[direct], nd.end[direct], un[direct], lo[direct], li[direct], o_own[direct], d_m[direct], d_i[direct]),
        # ... and, waiting, than its join (the last arrival) + its transfer
        (nd.join[jn.of[w]], nd.end[w], o_own[w], jn.transfer[w], tr_i[w]) + _fixed_zero(int(w.sum()), fixed)[:3],
        # a join waits for every member's arrival (a send's: its end; an op alone: lead after the item before)
        (np.where(sent, nd.end, nd.arrive)[via], nd.join[jn.of[via]]) + _fixed_zero(int(via.sum()), fixed),
        (fr[member & ~via], nd.join[jn.of[member & ~via]], un[member & ~via], lo[member & ~via], li[member & ~via])
        + _fixed_zero(int((member & ~via).sum()), fixed)[:3],
        # a cluster of several ops ends when its last op ends (a detached op: when it began)
        (np.where(det, nd.arrive, nd.end)[na], o_item[na]) + _fixed_zero(int(na.sum()), fixed),
        # the first piece that began after a detached op ended waits for it
        _waits(flat, nd.end, nd.node_of, dur, dur_i, P, fixed),
        *_rendezvous_columns(flat, jn, nd, (lo, li, fr, un), o_own, tr_i, fixed),
    ]


def _rendezvous_columns(flat: Flat, jn: Joins, nd: Nodes, prev: tuple[np.ndarray, ...], o_own: np.ndarray,
                        tr_i: np.ndarray, fixed: int) -> list[tuple[np.ndarray, ...]]:
    """A pair whose send waited for its recv: its rendezvous node waits for both arrivals (an op
    alone in its cluster: lead after the item before), and the send ends its own transfer after it."""
    lo, li, fr, un = prev
    rv_node = np.full(max(jn.rv_of.size, 1), -1, np.int64)
    rv_node[jn.rv_of >= 0] = nd.rv
    to = np.where(jn.of >= 0, rv_node[np.maximum(jn.of, 0)], -1)
    na, al = (to >= 0) & ~nd.alone, (to >= 0) & nd.alone
    rv = jn.rendezvous
    return [
        (nd.arrive[na], to[na]) + _fixed_zero(int(na.sum()), fixed),
        (fr[al], to[al], un[al], lo[al], li[al]) + _fixed_zero(int(al.sum()), fixed)[:3],
        (to[rv], nd.end[rv], o_own[rv], jn.rv_transfer[rv], tr_i[rv]) + _fixed_zero(int(rv.sum()), fixed)[:3],
    ]


def _op_typicals(flat: Flat, jn: Joins, det: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per op: its duration, its typical transfer (waiting ops, sends that waited for their recv: the
    median over those of its key) and its typical duration (the others)."""
    o_dur = flat.o_end - flat.o_start
    w, rv = jn.waits, jn.rendezvous
    nw = ~w & ~rv
    tr_i, du_i = np.zeros(o_dur.size), np.zeros(o_dur.size)
    tr_i[w] = _typical_of(flat.o_tkey[w], jn.transfer[w], ~det[w])
    tr_i[rv] = _typical_of(flat.o_tkey[rv], jn.rv_transfer[rv], ~det[rv])
    du_i[nw] = _typical_of(flat.o_tkey[nw], o_dur[nw], ~det[nw])
    return o_dur, tr_i, du_i


def _typical_of(keys: np.ndarray, values: np.ndarray, use: np.ndarray) -> np.ndarray:
    """Each op's typical value: the median of its key over the ops ``use`` marks (a detached op's end
    says when a recorder saw it done, not when it was: it joins no typical value), else its own."""
    out = values.astype(float)
    if use.any():
        inv = _dense(keys)
        got = _medians(inv[use], values[use], int(inv.max()) + 1)[inv]
        out = np.where(np.isnan(got), out, got)
    return out


def _waits(flat: Flat, end: np.ndarray, node_of: np.ndarray, dur: np.ndarray, dur_i: np.ndarray, P: int,
           fixed: int) -> tuple[np.ndarray, ...]:
    """Edges from each detached op's end to the first piece of its step that began after it ended
    (no earlier than that end, then the piece's duration: the measured gap between them is time the
    rank spent elsewhere, e.g. waiting in a recv, which its own edges carry; held fixed here it kept
    that waiting in every scenario)."""
    w = flat.o_waiter.astype(np.int64)
    ok = flat.o_detached.astype(bool) & (w >= 0)
    ok[ok] = flat.i_block[w[ok]] == flat.i_block[flat.o_item[ok]]
    k, w = np.flatnonzero(ok), w[ok]
    gap = np.zeros(k.size)
    return (end[k], node_of[w], np.full(k.size, fixed), gap, gap,
            flat.i_rank[w].astype(np.int64) * P + flat.i_name[w], dur[w], dur_i[w])


def _fixed_zero(n: int, fixed: int) -> tuple[np.ndarray, ...]:
    z = np.zeros(n)
    return (np.full(n, fixed), z, z, np.full(n, fixed), z, z)


def _lead_ideal(ikey: np.ndarray, lead: np.ndarray, has_prev: np.ndarray) -> np.ndarray:
    """The typical lead of each item: the mean over items of its key (0 for a rank's first item)."""
    out = np.zeros(lead.size)
    if has_prev.any():
        out[has_prev] = group_mean(ikey[has_prev], lead[has_prev])
    return out


def build(group: Sequence[ProcessState], clock: Clock | None = None, window: Window | None = None,
          sync: Sequence[str] = SYNC_DEFAULT) -> Graph | None:
    """The graph of one group of ranks (one source and attempt) over steps ``window`` (inclusive),
    on ``clock`` (None: each host shifted to the others' median at the collectives). ``sync``: the
    phases that end with a collective on ranks that recorded no comm op (data parallel without
    ``comm.*`` spans: the last such span of each step is the collective). None without an op."""
    if not group:
        return None
    names = Names()
    descs = {g.group: g.desc for d in group for g in d.comm_groups.values()}
    t0 = min((d.first_ts for d in group if d.first_ts is not None), default=0.0)
    ros = [rank_ops(d, names, descs, sync, window, clock, 0.0, t0) for d in group]
    chains = [chain(ro) for ro in ros]
    flat = flatten(ros, chains)
    if flat.i_start.size == 0:
        return None
    if clock is None:
        shift = host_shift(flat, [d.host for d in group])
        if shift.any():
            ir, orank = flat.i_rank.astype(np.int64), flat.o_rank.astype(np.int64)
            flat.i_start, flat.i_end = flat.i_start - shift[ir], flat.i_end - shift[ir]
            flat.o_start, flat.o_end = flat.o_start - shift[orank], flat.o_end - shift[orank]
    jn = joins(flat)
    phases = list(names.phases)
    wt = waits(flat)
    edges, kinds, blocks, item_node = _edges(flat, jn, wt, len(phases), len(group) * len(phases))
    graph = _assemble(flat, edges, blocks, item_node, [d.rank for d in group], phases)
    graph.kind = kinds[np.argsort(np.searchsorted(graph.steps, blocks).astype(np.int16 if graph.steps.size < (1 << 15)
                                                                           else np.int64), kind="stable")]
    graph.mesh = {i: dict(d.mesh) for i, d in enumerate(group) if d.mesh}
    # Collective members only (a recv's join is its send's end: when the sender's thread got back, late
    # on a loaded machine), and not an op that ended where it started (a Flight Recorder entry without
    # its completion time tells no end).
    timed = jn.waits & (flat.o_key < P2P_KEY) & (flat.o_end - flat.o_start > RESOLUTION_MS)
    graph.early = -jn.transfer[timed]
    graph.collective = {phases[int(i)] for i in np.unique(flat.o_name)}
    graph.waits, graph.snapped = int(wt.item.size), sum(c.snapped for c in chains)
    for ro in ros:
        for why, n in ro.left_out.items():
            graph.left_out[why] = graph.left_out.get(why, 0) + n
    return graph


def _assemble(flat: Flat, edges: list[np.ndarray], blocks: np.ndarray, item_node: np.ndarray, ranks: list[int],
              phases: list[str]) -> Graph:
    """Nodes sorted by block, edges by their destination's block; each block's exits and measured T."""
    steps, bidx = np.unique(blocks, return_inverse=True)
    nb = steps.size
    bidx = bidx.astype(np.int16 if nb < (1 << 15) else np.int64)  # a stable sort of int16 is a radix sort
    order = np.argsort(bidx, kind="stable")
    new = np.empty(order.size, np.int64)
    new[order] = np.arange(order.size)
    node_off = np.searchsorted(bidx[order], np.arange(nb + 1))
    src, dst = edges[0].astype(np.int64), edges[1].astype(np.int64)
    src = np.where(src >= 0, new[np.maximum(src, 0)], src)
    eb = bidx[dst]
    eo = np.argsort(eb, kind="stable")
    edge_off = np.searchsorted(eb[eo], np.arange(nb + 1))
    own = np.stack([edges[2], edges[5]], axis=1).astype(np.int64)[eo]
    wm = np.stack([edges[3], edges[6]], axis=1)[eo]
    wi = np.stack([edges[4], edges[7]], axis=1)[eo]
    ni = flat.i_start.size
    rank = flat.i_rank.astype(np.int64)
    ib = bidx[item_node]
    last = np.ones(ni, bool)
    last[:-1] = (rank[1:] != rank[:-1]) | (ib[1:] != ib[:-1])
    exits = np.full((nb, len(ranks)), -1, np.int64)
    exits[ib[last], rank[last]] = new[item_node[last]]
    measured = np.full(nb, -np.inf)
    np.maximum.at(measured, ib[last], flat.i_end[last])
    first = np.full(len(ranks), np.nan)
    heads = flat.i_prev < 0
    first[rank[heads]] = flat.i_start[heads]
    return Graph(ranks, phases, steps, src[eo], new[dst][eo], own, wm, wi, node_off, edge_off, exits, first, measured)


