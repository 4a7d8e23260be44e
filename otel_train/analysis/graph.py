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

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from otel_train import schema
from otel_train.analysis.clock import Clock
from otel_train.analysis.pools import beside_a_copy, can_fork
from otel_train.analysis.spans import NO_STEP, ProcessState
from otel_train.analysis.stats import columns

UNTRACED = "(untraced)"
"""The phase owning each item's lead: time on a rank that no leaf and no comm op covers."""

Window = tuple[int, int]
RESOLUTION_MS = 0.002
"""Records keep µs timestamps and 1/1000 ms durations: ends and starts this close touch."""
P2P_KEY = 1 << 62
"""Match keys of send/recv pairs are this or above (collectives: group and seq; sync spans: 1 << 61 up)."""
UNSYNCED_SLACK_MS = 1.0
"""A member that ends a collective more than this before the last member arrived
shows that the op does not synchronise its members, or that the clocks compared are off by more than
the causal bounds of docs/clock.md allow."""
UNSYNCED_SHARE = 0.1
"""The replay's model does not apply to a group when more than this share of its collective members
(or of the sync phase's) ended that early: its answers would be nonsense (a negative ideal)."""

# Node kinds
PIECE, ARRIVE, JOIN, END, EXIT = range(5)


@dataclass(slots=True)
class RankOps:
    """One rank's leaves and comm ops, ms on the aligned clock (ops outside the window left out)."""

    l_start: np.ndarray
    l_end: np.ndarray
    l_step: np.ndarray
    l_name: np.ndarray  # index into the graph's phases
    c_start: np.ndarray
    c_end: np.ndarray
    c_step: np.ndarray
    c_name: np.ndarray  # index into phases (comm.<op>, or the sync phase)
    c_key: np.ndarray  # int64 match key (group and seq, or the pair and seq); -1: unmatched
    c_send: np.ndarray  # bool: a send (may end before its recv arrives)
    c_tkey: np.ndarray  # index of (name, group desc, bytes): the typical transfer's key


@dataclass(slots=True)
class Graph:
    """Nodes and weighted edges of one group of ranks, in step blocks (see the module doc).

    ``own[e, t]`` is the owner column of term ``t`` of edge ``e`` (``rank index * len(phases) +
    phase``; ``fixed`` = always measured), ``wm``/``wi`` its measured and typical ms. Edges of block
    ``b`` are ``edges[b]:edges[b+1]``, its nodes ``nodes[b]:nodes[b+1]``; an edge's ``src < 0`` is
    rank ``-1 - src``'s boundary (its last end in an earlier block). ``exits[b, r]``: rank r's last
    node in block b (-1: none). ``measured[b]``: T[b] as recorded.
    """

    ranks: list[int]
    phases: list[str]
    steps: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    own: np.ndarray
    wm: np.ndarray
    wi: np.ndarray
    nodes: np.ndarray
    edges: np.ndarray
    exits: np.ndarray
    first: np.ndarray
    measured: np.ndarray
    mesh: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    collective: set[str] = field(default_factory=set)  # the phases of comm ops (or sync spans)
    kind: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # per node: PIECE, ARRIVE, ...
    plans: dict[Any, Any] = field(default_factory=dict, repr=False)
    block_plans: dict[int, Any] = field(default_factory=dict, repr=False)  # block -> its plan (one of plans)
    terms: Any = field(default=None, repr=False)  # the weights' typical sums and deltas (see _weights)
    early: np.ndarray = field(default_factory=lambda: np.empty(0))  # ms each timed collective member ended before its join
    node_level: Any = field(default=None, repr=False)  # every node's level, all blocks at once (see _all_levels)

    def unsynchronized(self) -> dict[str, Any] | None:
        """None when the collectives synchronise the ranks; else ``{"ranks", "sync", "share", "early_ms"}``
        (:func:`unsynchronized`), as ``whatif.SyncTable.unsynchronized`` gives it."""
        found = unsynchronized(self.early)
        return None if found is None else {"ranks": list(self.ranks), "sync": sorted(self.collective), **found}

    @property
    def fixed(self) -> int:
        """The owner column that is measured in every scenario."""
        return len(self.ranks) * len(self.phases)

    def owner(self, rank_index: np.ndarray | int, phase: np.ndarray | int) -> np.ndarray | int:
        return rank_index * len(self.phases) + phase


# ---------------------------------------------------------------------------------------------
# Reading ops from a process


class Names:
    """Phase names and typical-transfer keys, numbered as first seen."""

    def __init__(self) -> None:
        self.phases: dict[str, int] = {UNTRACED: 0}
        self.tkeys: dict[tuple[str, str, int], int] = {}
        self.groups: dict[str, int] = {}

    def phase(self, name: str) -> int:
        return self.phases.setdefault(name, len(self.phases))

    def tkey(self, key: tuple[str, str, int]) -> int:
        return self.tkeys.setdefault(key, len(self.tkeys))

    def group(self, name: str) -> int:
        return self.groups.setdefault(name, len(self.groups))


def leaf_names(d: ProcessState) -> list[str]:
    """The names of ``d``'s leaf spans: no other non-comm name has them as its parent."""
    plain = [n for n in d.phases if not n.startswith(schema.COMM_PREFIX)]
    parents = {d.parents.get(n) for n in plain}
    return [n for n in plain if n not in parents]


def _to_ms(t: np.ndarray, d: ProcessState, clock: Clock | None, shift: float, t0: float) -> np.ndarray:
    """Unix seconds of ``d``'s host to ms since ``t0`` on the reference clock."""
    hc = clock.hosts.get(d.host) if clock is not None and d.host is not None and not clock.raw else None
    if hc is not None:
        t = (t - hc.offset_s + hc.drift * clock.t0) / (1.0 + hc.drift)  # type: ignore[union-attr]
    return (t - shift - t0) * 1000.0


def _in_window(steps: np.ndarray, window: Window | None) -> np.ndarray:
    ok = steps != NO_STEP
    if window is not None:
        ok &= (steps >= window[0]) & (steps <= window[1])
    return ok


def _leaves(d: ProcessState, names: Names, sync: Sequence[str], window: Window | None
            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(start s, end s, step, name) columns of the leaves, and the same of the sync leaves (the last
    span of a sync name per step) when the process has no comm op (the data-parallel special case)."""
    plain, synced = [], []
    use_sync = len(d.comm) == 0
    for name in leaf_names(d):
        steps, durs, ends = columns(d, name)
        ok = _in_window(steps, window)
        cols = [ends[ok] - durs[ok] / 1000.0, ends[ok].copy(), steps[ok].copy(),
                np.full(int(ok.sum()), names.phase(name), np.int64)]
        if use_sync and name in sync and cols[0].size:
            order = np.lexsort((cols[1], cols[2]))
            last = np.ones(order.size, bool)
            last[:-1] = cols[2][order][1:] != cols[2][order][:-1]
            is_sync = np.zeros(order.size, bool)
            is_sync[order[last]] = True
            synced.append([c[is_sync] for c in cols])
            cols = [c[~is_sync] for c in cols]
        plain.append(cols)
    return _cat(plain, 4), _cat(synced, 4)


def _cat(parts: list[list[np.ndarray]], n: int) -> list[np.ndarray]:
    if not parts:
        return [np.empty(0), np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)][:n]
    return [np.concatenate([p[i] for p in parts]) for i in range(n)]


def _comm(d: ProcessState, names: Names, descs: dict[str, str], window: Window | None) -> list[np.ndarray]:
    """(start s, end s, step, name, key, send, tkey) of the process's host-clock comm ops."""
    log = d.comm
    n = len(log)
    if n == 0:
        return [np.empty(0), np.empty(0)] + [np.empty(0, np.int64)] * 3 + [np.empty(0, bool), np.empty(0, np.int64)]
    start, end = np.frombuffer(log.start, np.float64), np.frombuffer(log.end, np.float64)
    seq, peer = np.frombuffer(log.seq, np.int64), np.frombuffer(log.peer, np.int64)
    nbytes, step = np.frombuffer(log.nbytes, np.int64), np.frombuffer(log.step, np.int64)
    codes = np.frombuffer(log.codes, np.uint32).reshape(-1, 6)
    s = log.strings
    device = s.index(schema.COMM_CLOCK_DEVICE) if schema.COMM_CLOCK_DEVICE in s else -1
    ok = _in_window(step, window) & ~np.isnan(end) & (codes[:, 4] != device) & (seq >= 0)
    used_ops = np.unique(codes[ok, 1])
    op_of = np.zeros(len(s), np.int64)
    op_of[used_ops] = [names.phase(schema.comm_span_name(s[c] or "")) for c in used_ops.tolist()]
    gid = np.full(len(s), -1, np.int64)
    used_groups = np.unique(codes[ok, 0])
    gid[used_groups] = [names.group(s[c] or "") for c in used_groups.tolist()]
    p2p_code = np.zeros(len(s), bool)
    send_code = np.zeros(len(s), bool)
    for c in used_ops.tolist():
        p2p_code[c], send_code[c] = s[c] in schema.P2P_OPS, s[c] == "send"
    p2p = p2p_code[codes[:, 1]] & (peer >= 0)
    send = p2p & send_code[codes[:, 1]]
    src = np.where(send, d.rank, peer)
    dst = np.where(send, peer, d.rank)
    g = gid[codes[:, 0]]
    key = np.where(p2p, (((g * 4096 + src) * 4096 + dst) << 24) + seq + P2P_KEY, (g << 32) + seq)
    tkey = _tkeys(codes[ok, 1].astype(np.int64), codes[ok, 0].astype(np.int64), nbytes[ok], s, names, descs)
    return [start[ok], end[ok], step[ok].copy(), op_of[codes[ok, 1]], key[ok], send[ok], tkey]


def _tkeys(op: np.ndarray, grp: np.ndarray, nbytes: np.ndarray, s: Sequence[str | None], names: Names,
           descs: dict[str, str]) -> np.ndarray:
    """Each op's typical-transfer key: (op name, group desc, bytes), numbered in ``names`` (one 1-D
    unique over a combined int64 code, not a row-wise unique of the triples)."""
    if op.size == 0:
        return np.empty(0, np.int64)
    nb, nbi = np.unique(nbytes, return_inverse=True)
    uniq, inv = np.unique((op * len(s) + grp) * nb.size + nbi.reshape(-1), return_inverse=True)
    pair, size = uniq // nb.size, nb[uniq % nb.size]
    tk = [names.tkey((s[o] or "", descs.get(s[g] or "", ""), int(n)))
          for o, g, n in zip((pair // len(s)).tolist(), (pair % len(s)).tolist(), size.tolist())]
    return np.array(tk, np.int64)[inv.reshape(-1)]


def rank_ops(d: ProcessState, names: Names, descs: dict[str, str], sync: Sequence[str], window: Window | None,
             clock: Clock | None, shift: float, t0: float) -> RankOps:
    """Every op of one process, in ms on the reference clock (``shift``: a host's median offset, s)."""
    (ls, le, lstep, lname), synced = _leaves(d, names, sync, window)
    cs, ce, cstep, cname, ckey, csend, ctkey = _comm(d, names, descs, window)
    if synced[0].size:
        # No comm op: the last span of each sync phase per step is the collective (keyed by its step).
        cs, ce, cstep, cname = synced
        ckey = cstep + (1 << 61)
        csend = np.zeros(cs.size, bool)
        ctkey = np.array([names.tkey((f"sync:{n}", "", -1)) for n in cname.tolist()], np.int64)
    ms = [_to_ms(x, d, clock, shift, t0) for x in (ls, le, cs, ce)]
    return RankOps(ms[0], ms[1], lstep, lname, ms[2], ms[3], cstep, cname, ckey, csend, ctkey)


# ---------------------------------------------------------------------------------------------
# One rank's chain: the cover of its leaves cut by its comm clusters


@dataclass(slots=True)
class Chain:
    """One rank's items in order (pieces and clusters) and its comm ops sorted by start.

    ``piece`` is the piece index of a piece, -1 for a cluster; ``name`` a piece's leaf name, a
    cluster's first op's; ``op_item`` the item (cluster) of each sorted comm op; ``order`` sorts the
    rank's comm columns."""

    start: np.ndarray
    end: np.ndarray
    block: np.ndarray
    name: np.ndarray
    piece: np.ndarray
    op_item: np.ndarray
    order: np.ndarray
    detached: np.ndarray  # per sorted op: it ended after the rank's next span began (the thread went on)
    waiter: np.ndarray  # per sorted op: the first piece that began after a detached op ended (-1: none)


def _clusters(cs: np.ndarray, ce: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cluster of each op, cluster starts, cluster ends) of ops sorted by start: ops that overlap in
    time (an op starting before the ones before it all ended) share a cluster."""
    if cs.size == 0:
        return np.empty(0, np.int64), np.empty(0), np.empty(0)
    reach = np.maximum.accumulate(ce)
    new = np.ones(cs.size, bool)
    new[1:] = cs[1:] >= reach[:-1]
    heads = np.flatnonzero(new)
    return np.cumsum(new) - 1, cs[heads], np.maximum.reduceat(ce, heads)


def _pieces(ls: np.ndarray, le: np.ndarray, cl_s: np.ndarray, cl_e: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, leaf) of the pieces: sorted, non-overlapping leaves minus the clusters, cut at
    every cluster boundary."""
    cuts = np.concatenate([cl_s, cl_e])
    pts = np.unique(np.concatenate([ls, le, cuts]))
    if pts.size < 2:
        return np.empty(0), np.empty(0), np.empty(0, np.int64)
    a, b = pts[:-1], pts[1:]
    mid = (a + b) / 2.0
    j = np.searchsorted(cl_s, mid, side="right") - 1
    in_cl = (j >= 0) & (mid < cl_e[np.maximum(j, 0)]) if cl_s.size else np.zeros(mid.size, bool)
    i = np.searchsorted(ls, mid, side="right") - 1
    leaf = np.where((i >= 0) & (mid < le[np.maximum(i, 0)]) & ~in_cl, i, -1)
    keep = leaf >= 0
    a, b, leaf = a[keep], b[keep], leaf[keep]
    if a.size == 0:
        return a, b, leaf
    new = np.ones(a.size, bool)
    new[1:] = (leaf[1:] != leaf[:-1]) | (a[1:] != b[:-1]) | np.isin(a[1:], cuts)
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:], a.size) - 1
    return a[heads], b[tails], leaf[heads]


def _blocks(step: np.ndarray, is_piece: np.ndarray) -> np.ndarray:
    """Each item's step block: a piece's own step (never below an earlier piece's); a cluster its own
    step held between the blocks of the pieces around it: a comm op's own step can be off (an op only
    Flight Recorder's buffer saw carries the step current when the recorder looked)."""
    if not is_piece.any():
        return np.maximum.accumulate(step) if step.size else step
    pieces = np.flatnonzero(is_piece)
    held = np.maximum.accumulate(step[pieces])
    before = np.searchsorted(pieces, np.arange(step.size), side="right") - 1
    low = np.where(before >= 0, held[np.maximum(before, 0)], np.iinfo(np.int64).min)
    after = np.minimum(before + 1, pieces.size - 1)
    high = np.where(before + 1 < pieces.size, held[after], np.iinfo(np.int64).max)
    return np.where(is_piece, held[np.maximum(before, 0)], np.minimum(np.maximum(step, low), high))


def chain(ro: RankOps) -> Chain:
    """The rank's items: pieces and clusters sorted by start (a cluster before a piece starting with it)."""
    lo = np.argsort(ro.l_start, kind="stable")
    ls, le = ro.l_start[lo], ro.l_end[lo]
    if ls.size:  # serialise overlapping leaves: each starts no earlier than the ones before it ended
        reach = np.maximum.accumulate(le)
        ls = np.maximum(ls, np.concatenate([[-np.inf], reach[:-1]]))
        le = np.maximum(le, ls)
    order = np.argsort(ro.c_start, kind="stable")
    cs, ce = ro.c_start[order], ro.c_end[order]
    nxt = np.searchsorted(ls, cs, side="right")
    nxt_start = ls[np.minimum(nxt, ls.size - 1)] if ls.size else np.full(cs.size, np.inf)
    detached = (nxt < ls.size) & (ce > nxt_start + RESOLUTION_MS)
    of, cl_s, cl_e = _clusters(cs, np.where(detached, cs, ce))
    ps, pe, leaf = _pieces(ls, le, cl_s, cl_e)
    _, first, counts = np.unique(leaf, return_index=True, return_counts=True)
    piece = np.arange(leaf.size) - np.repeat(first, counts)  # leaf is non-decreasing: pieces in time order
    cl_step = np.minimum.reduceat(ro.c_step[order], np.flatnonzero(np.diff(of, prepend=-1))) if cs.size else of
    cl_name = ro.c_name[order][np.flatnonzero(np.diff(of, prepend=-1))] if cs.size else of
    start = np.concatenate([ps, cl_s])
    kind = np.concatenate([np.ones(ps.size, np.int64), np.zeros(cl_s.size, np.int64)])
    items = np.lexsort((kind, start))
    step = np.concatenate([ro.l_step[lo][leaf], cl_step])[items]
    block = _blocks(step, kind[items] == 1)
    where = np.empty(items.size, np.int64)
    where[items] = np.arange(items.size)
    pieces = np.flatnonzero(kind[items] == 1)
    at = np.searchsorted(start[items][pieces], ce - 1e-9)
    waiter = np.where(detached & (at < pieces.size), pieces[np.minimum(at, max(pieces.size - 1, 0))] if pieces.size
                      else -1, -1)
    return Chain(start[items], np.concatenate([pe, cl_e])[items], block,
                 np.concatenate([ro.l_name[lo][leaf], cl_name])[items],
                 np.concatenate([piece, np.full(cl_s.size, -1)])[items], where[ps.size + of], order, detached, waiter)


# ---------------------------------------------------------------------------------------------
# The graph of a group


SYNC_DEFAULT = ("backward",)


def _dense(keys: np.ndarray) -> np.ndarray:
    """Small non-negative group numbers for ``keys`` (the keys themselves when they already are: no sort)."""
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo <= 4 * keys.size + 4096:
        return keys - lo
    return np.unique(keys, return_inverse=True)[1].reshape(-1)


def group_mean(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each element's group mean (groups by equal key)."""
    if keys.size == 0:
        return values.astype(float)
    inv = _dense(keys)
    counts = np.bincount(inv)
    return (np.bincount(inv, weights=values) / np.maximum(counts, 1))[inv]


def group_median(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each element's group median (groups by equal key)."""
    if keys.size == 0:
        return values.astype(float)
    inv = _dense(keys)
    return _medians(inv, values, int(inv.max()) + 1)[inv]


def _medians(inv: np.ndarray, values: np.ndarray, m: int) -> np.ndarray:
    """The median of each group ``0..m-1`` of ``values`` (``inv``: each value's group; NaN: empty)."""
    counts = np.bincount(inv, minlength=m)
    med = np.full(m, np.nan)
    present = np.flatnonzero(counts)
    if present.size <= 64:  # few keys (the usual case): a median per key beats sorting everything twice
        for k in present.tolist():
            med[k] = np.median(values[inv == k])
        return med
    order = np.lexsort((values, inv))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])[present]
    v = values[order]
    med[present] = (v[first + (counts[present] - 1) // 2] + v[first + counts[present] // 2]) / 2.0
    return med


@dataclass(slots=True)
class Flat:
    """Every rank's items and comm ops, concatenated (item ids are global)."""

    i_rank: np.ndarray
    i_start: np.ndarray
    i_end: np.ndarray
    i_block: np.ndarray
    i_name: np.ndarray
    i_piece: np.ndarray
    i_prev: np.ndarray  # the item before on the rank, -1 for the first
    o_rank: np.ndarray
    o_item: np.ndarray
    o_start: np.ndarray
    o_end: np.ndarray
    o_name: np.ndarray
    o_key: np.ndarray
    o_send: np.ndarray
    o_tkey: np.ndarray
    o_detached: np.ndarray
    o_waiter: np.ndarray  # global item id, -1: none


def flatten(ros: list[RankOps], chains: list[Chain]) -> Flat:
    """Concatenate the ranks' chains into global item and op columns."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in Flat.__slots__}  # type: ignore[attr-defined]
    base = 0
    for r, (ro, ch) in enumerate(zip(ros, chains)):
        n = ch.start.size
        o = ch.order
        prev = np.arange(base - 1, base + n - 1)
        if n:
            prev[0] = -1
        for k, v in (("i_rank", np.full(n, r)), ("i_start", ch.start), ("i_end", ch.end), ("i_block", ch.block),
                     ("i_name", ch.name), ("i_piece", ch.piece), ("i_prev", prev),
                     ("o_rank", np.full(o.size, r)), ("o_item", ch.op_item + base), ("o_start", ro.c_start[o]),
                     ("o_end", ro.c_end[o]), ("o_name", ro.c_name[o]), ("o_key", ro.c_key[o]),
                     ("o_send", ro.c_send[o]), ("o_tkey", ro.c_tkey[o]), ("o_detached", ch.detached),
                     ("o_waiter", np.where(ch.waiter >= 0, ch.waiter + base, -1))):
            parts[k].append(v)
        base += n
    return Flat(*(np.concatenate(parts[k]) if parts[k] else np.empty(0) for k in Flat.__slots__))  # type: ignore[attr-defined]


def host_shift(flat: Flat, hosts: list[str | None]) -> np.ndarray:
    """Per rank, ms to subtract so that its host's ranks leave collectives with the others at the
    median (the clock when no estimate applies; 0 for one host)."""
    shift = np.zeros(len(hosts))
    if len(set(hosts)) < 2 or flat.o_key.size == 0:
        return shift
    coll = flat.o_key < P2P_KEY
    key, end, rank = flat.o_key[coll], flat.o_end[coll], flat.o_rank[coll].astype(np.int64)
    late = end - group_median(key, end)
    host_of = np.array([hash(h) for h in hosts])[rank]
    for h in set(hosts):
        mine = host_of == hash(h)
        if mine.any():
            shift[[j for j, x in enumerate(hosts) if x == h]] = np.median(late[mine])
    return shift - np.median(shift)


@dataclass(slots=True)
class Joins:
    """Per op: its join (-1: none), whether it waits for the join, its transfer time (ms), whether it
    is a send that waited for its recv (``rendezvous``) and that wait's transfer (its end minus the
    later of the two arrivals); per join its block, and per p2p join its rendezvous node's index
    (-1: a collective)."""

    of: np.ndarray
    waits: np.ndarray
    transfer: np.ndarray
    block: np.ndarray
    rendezvous: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    rv_transfer: np.ndarray = field(default_factory=lambda: np.empty(0))
    rv_of: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


def joins(flat: Flat) -> Joins:
    """Match ops by key: a join needs two members or more, all in one block."""
    n = flat.o_key.size
    if n == 0:
        e = np.empty(0, np.int64)
        return Joins(e, np.empty(0, bool), np.empty(0), e, np.empty(0, bool), np.empty(0), e)
    _, inv = np.unique(flat.o_key, return_inverse=True)
    m = int(inv.max()) + 1
    block = flat.i_block[flat.o_item]
    lo, hi = np.full(m, np.iinfo(np.int64).max), np.full(m, np.iinfo(np.int64).min)
    np.minimum.at(lo, inv, block)
    np.maximum.at(hi, inv, block)
    # A collective's members are ready at their arrivals; a p2p pair at the recv's arrival and the
    # send's end (the data is there when the send is done: the recv's own transfer is what follows),
    # a detached send's arrival (its end is when its rank waited for it, not when the data left).
    last = np.full(m, -np.inf)
    np.maximum.at(last, inv, np.where(flat.o_send & ~flat.o_detached.astype(bool), flat.o_end, flat.o_start))
    valid = (np.bincount(inv, minlength=m) >= 2) & (lo == hi)
    ids = np.cumsum(valid) - 1
    of = np.where(valid[inv], ids[inv], -1)
    transfer = flat.o_end - last[inv]
    # The recv ends no earlier than the later of its arrival and its send's end, plus its transfer.
    waits = (of >= 0) & ~flat.o_send
    rendezvous, rv_transfer, rv_of = _rendezvous(flat, inv, m, valid, of)
    return Joins(of, waits, transfer, lo[valid], rendezvous, rv_transfer, rv_of)


def _rendezvous(flat: Flat, inv: np.ndarray, m: int, valid: np.ndarray, of: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per op: whether it is a send that waited for its recv (it ended more than the records'
    resolution after the recv's arrival: gloo's and NCCL's sends block until the receiver is there),
    and its transfer then (its end minus the later of the two arrivals); per valid join, the index of
    its rendezvous node (the later arrival of its members; only pairs whose send waited have one:
    an eager send's pair keeps no edge back from the recv's arrival, so two ranks that each send,
    then receive, make no cycle), -1 for the others. A send that ended before its recv was posted
    (eager) ends its own duration after its arrival."""
    recv_at = np.full(m, -np.inf)
    np.maximum.at(recv_at, inv, np.where(flat.o_send, -np.inf, flat.o_start))
    both = np.maximum(recv_at[inv], flat.o_start)
    waited, after = recv_at[inv] - flat.o_start, flat.o_end - recv_at[inv]
    rendezvous = (of >= 0) & flat.o_send & (after > RESOLUTION_MS) & (waited > after)
    has_rv = np.zeros(m, bool)
    has_rv[inv[rendezvous]] = True
    p2p = has_rv[valid]
    rv_of = np.where(p2p, np.cumsum(p2p) - 1, -1)
    return rendezvous, np.where(rendezvous, flat.o_end - both, 0.0), rv_of


def _edges(flat: Flat, jn: Joins, P: int, fixed: int
           ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Edge columns [src, dst, own0, wm0, wi0, own1, wm1, wi1], node kinds, node blocks, and each
    item's node.

    Nodes: one per piece (its end) and per cluster of several ops (its exit), then each op's
    arrival, each op's end (a one-op cluster's item node), each join. An op alone in its cluster has
    no arrival node: its edges leave the item before it, carrying the lead (its offset is 0)."""
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
    cols = _columns(flat, jn, P, fixed, Nodes(arrive, end, ni + 2 * no + np.arange(nj), from_, node_of, alone,
                                              ni + 2 * no + nj + np.arange(nr)), lead, rank)
    edges = [np.concatenate([c[k] for c in cols]) for k in range(8)]
    kinds = np.concatenate([np.where(flat.i_piece >= 0, PIECE, EXIT), np.full(no, ARRIVE), np.full(no, END),
                            np.full(nj + nr, JOIN)])
    blocks = np.concatenate([flat.i_block, flat.i_block[o_item], flat.i_block[o_item], jn.block,
                             jn.block[jn.rv_of >= 0]])
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


def _columns(flat: Flat, jn: Joins, P: int, fixed: int, nd: Nodes, lead: np.ndarray, rank: np.ndarray
             ) -> list[tuple[np.ndarray, ...]]:
    """The edge columns of :func:`_edges`, by kind of edge."""
    o_item, al, na = flat.o_item, nd.alone, ~nd.alone
    ikey = flat.i_name * (int(flat.i_piece.max(initial=0)) + 2) + flat.i_piece + 1  # (name, piece), compact
    lead_i = _lead_ideal(ikey, lead, flat.i_prev >= 0)
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
    flat = flatten(ros, [chain(ro) for ro in ros])
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
    edges, kinds, blocks, item_node = _edges(flat, jn, len(phases), len(group) * len(phases))
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
    return graph


def unsynchronized(early_ms: np.ndarray) -> dict[str, float] | None:
    """None when the ops synchronise their members; else ``{"share", "early_ms"}``: the share of
    them whose member ended more than :data:`UNSYNCED_SLACK_MS` before the last arrival (over
    :data:`UNSYNCED_SHARE`), and the median of how early."""
    early = early_ms[early_ms > UNSYNCED_SLACK_MS]
    share = early.size / early_ms.size if early_ms.size else 0.0
    return {"share": share, "early_ms": float(np.median(early))} if share > UNSYNCED_SHARE else None


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


# ---------------------------------------------------------------------------------------------
# Simulation


@dataclass(slots=True)
class Plan:
    """One block's evaluation order. Local node positions: the ranks' boundaries first, then the
    block's nodes by level, within a level those with one input first; a last row is the padding
    (-inf). ``levels``: (p0, pm, p1, src, edge, idx, wid) per level: nodes p0..pm take ``V[src] +
    W[edge]``, nodes pm..p1 the max over their inputs ``V[idx] + W[wid]`` (padded, F inputs a row)."""

    levels: list[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    exits: np.ndarray
    exit_ranks: np.ndarray
    n: int
    edges: int


def _successors(frontier: np.ndarray, starts: np.ndarray, out_dst: np.ndarray) -> np.ndarray:
    """The destinations of every edge out of ``frontier`` (edges sorted by source; ``starts[v]``: where
    node v's edges begin), repeats kept."""
    counts = starts[frontier + 1] - starts[frontier]
    base = np.repeat(starts[frontier] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return out_dst[base + np.arange(int(counts.sum()))]


def _levels(src: np.ndarray, dst: np.ndarray, n: int, is_join: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each local node's level (longest path from the boundaries, in edges), Kahn's way, a level at a
    time; and which edges are kept. Ops that wait for each other in a cycle (ties on aligned clocks
    could make one: collectives issued in different orders at the same instant) lose their joins'
    edges inside the cycle: they end as their arrival allows."""
    keep = np.ones(src.size, bool)
    indeg = np.bincount(dst, minlength=n + 1)  # node n: where dropped edges lead
    order = np.argsort(src, kind="stable")
    out_dst = dst[order]
    starts = np.searchsorted(src[order], np.arange(n + 1))
    level = np.full(n, -1, np.int64)
    frontier = np.flatnonzero(indeg[:n] == 0)
    lev = 0
    while True:
        while frontier.size:
            level[frontier] = lev
            reached = _successors(frontier, starts, out_dst)
            indeg -= np.bincount(reached, minlength=n + 1)
            frontier = np.unique(reached[(reached < n) & (indeg[reached] == 0)])
            lev += 1
        left = level < 0
        if not left.any():
            return level, keep
        core = left.copy()  # the cycles: what is left, less what only waits downstream of them
        while True:
            inside = keep & core[src] & core[dst]
            has_out = np.zeros(n, bool)
            has_out[src[inside]] = True
            if (core == (core & has_out)).all():
                break
            core &= has_out
        cut = keep & core[src] & core[dst] & is_join[src]
        if not cut.any():
            raise ValueError("the dependency graph has a cycle")  # cannot happen: only joins wait
        keep &= ~cut
        indeg[:n] -= np.bincount(dst[cut], minlength=n)
        dropped = np.zeros(src.size, bool)
        dropped[cut] = True
        out_dst = np.where(dropped[order], n, out_dst)
        frontier = np.flatnonzero(left & (indeg[:n] == 0))


def plan(g: Graph, b: int) -> Plan:
    """Block ``b``'s :class:`Plan`, shared by every block with the same structure (cached on ``g``)."""
    got = g.block_plans.get(b)
    if got is not None:
        return got
    g.block_plans[b] = got = _plan(g, b)
    return got


def _all_levels(g: Graph) -> np.ndarray:
    """Every node's level in its block (as :func:`_levels` gives it), all blocks in one Kahn pass: each
    block's edges stay inside it, and every boundary is one source at level 0. -1: a node on a cycle
    (its block is levelled alone, by :func:`_levels`). One pass of a few numpy calls per level instead
    of one per level and block (1,000 blocks: 1.15 s -> about 0.1 s)."""
    N = int(g.nodes[-1])
    src = np.where(g.src < 0, N, g.src)
    indeg = np.bincount(g.dst, minlength=N + 1)
    order = np.argsort(src, kind="stable")
    out_dst = g.dst[order]
    starts = np.searchsorted(src[order], np.arange(N + 2))
    level = np.full(N + 1, -1, np.int64)
    frontier, lev = np.flatnonzero(indeg == 0), 0
    while frontier.size:
        level[frontier] = lev
        reached, times = np.unique(_successors(frontier, starts, out_dst), return_counts=True)
        indeg[reached] -= times
        frontier = reached[indeg[reached] == 0]
        lev += 1
    return level[:N]


def _plan(g: Graph, b: int) -> Plan:
    R = len(g.ranks)
    n0, n1, e0, e1 = g.nodes[b], g.nodes[b + 1], g.edges[b], g.edges[b + 1]
    src, dst = g.src[e0:e1], g.dst[e0:e1]
    src_l = np.where(src < 0, -1 - src, R + src - n0)
    dst_l = R + dst - n0
    ex = g.exits[b]
    have = np.flatnonzero(ex >= 0)
    key = (int(n1 - n0), src_l.tobytes(), dst_l.tobytes(), (ex[have] - n0).tobytes(), have.tobytes())
    found = g.plans.get(key)
    if found is not None:
        return found
    n = R + int(n1 - n0)
    if g.node_level is None:
        g.node_level = _all_levels(g)
    mine = g.node_level[n0:n1]
    if (mine >= 0).all():
        level, kept = np.concatenate([np.zeros(R, np.int64), mine]), np.ones(src_l.size, bool)
    else:
        level, kept = _levels(src_l, dst_l, n, np.concatenate([np.zeros(R, bool), g.kind[n0:n1] == JOIN]))
    edge = np.flatnonzero(kept)
    fan = np.bincount(dst_l[edge], minlength=n)
    rank_key = (level * 2 + (fan > 1))[R:]  # by level, within a level the nodes of one input first
    narrow = np.int16 if n < (1 << 14) else np.int64  # keys and positions below 2 n: an int16 stable sort is radix
    perm = np.argsort(rank_key.astype(narrow), kind="stable")
    pos = np.arange(n)
    pos[R + perm] = R + np.arange(perm.size)
    pd = pos[dst_l[edge]]
    eo = np.argsort(pd.astype(narrow), kind="stable")
    edge, pd, ps = edge[eo], pd[eo], pos[src_l[edge[eo]]]
    key_sorted = rank_key[perm]
    heads = np.flatnonzero(np.diff(key_sorted, prepend=-1))
    ends = np.append(heads[1:], key_sorted.size) + R
    spans: dict[int, list[int]] = {}  # level -> [p0, pm, p1]
    for k, h, t in zip(key_sorted[heads].tolist(), (heads + R).tolist(), ends.tolist()):
        got = spans.setdefault(k // 2, [h, h, t])
        if k % 2 == 0:
            got[1] = t
        got[2] = t
    levels = _level_inputs(pd, ps, edge, [tuple(v) for _, v in sorted(spans.items())], n, int(e1 - e0))
    out = Plan(levels, pos[R + ex[have] - n0], have, n, int(e1 - e0))
    g.plans[key] = out
    return out


def _level_inputs(pd: np.ndarray, ps: np.ndarray, edge: np.ndarray, bounds: list[tuple[int, int, int]], pad_v: int,
                  pad_w: int) -> list[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Every level's (p0, pm, p1, src, edge, idx, wid) (:class:`Plan`): its one-input nodes' source and
    edge, and its other nodes' inputs padded to the level's widest (``pad_v``: the -inf row, ``pad_w``:
    the zero weight), laid out once for the whole block (a few numpy calls a block, not a level): the
    padding holds only the nodes of several inputs, and each level's width is one ``reduceat``."""
    counts = np.bincount(pd, minlength=pad_v)
    col = np.arange(pd.size) - np.repeat(np.cumsum(counts) - counts, counts)
    several = counts > 1
    row = np.cumsum(several) - 1  # a node of several inputs: its row of the padding
    into = several[pd]
    idx = np.full((max(int(several.sum()), 1), max(int(counts.max(initial=0)), 1)), pad_v)
    wid = np.full(idx.shape, pad_w)
    at = (row[pd[into]], col[into])
    idx[at], wid[at] = ps[into], edge[into]
    b = np.array(bounds, np.int64).reshape(-1, 3)
    cuts = np.searchsorted(pd, b[:, :2]).tolist()
    has = b[:, 2] > b[:, 1]
    widths = np.zeros(b.shape[0], np.int64)
    first = np.zeros(b.shape[0], np.int64)
    if has.any():
        widths[has] = np.maximum.reduceat(np.append(counts, 0), b[has][:, 1:].ravel())[::2]
        first[has] = row[b[has, 1]]
    out = []
    for (p0, pm, p1), (q0, qm), w, r in zip(bounds, cuts, widths.tolist(), first.tolist()):
        out.append((p0, pm, p1, ps[q0:qm], edge[q0:qm], np.ascontiguousarray(idx[r:r + p1 - pm, :w]),
                    np.ascontiguousarray(wid[r:r + p1 - pm, :w])))
    return out


def _weight_terms(g: Graph) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(per edge the sum of its typical terms, per term ``measured - typical``, per term the edges
    where that differs), computed once per graph."""
    if g.terms is None:
        with np.errstate(invalid="ignore"):
            delta = np.where(g.wm == g.wi, 0.0, g.wm - g.wi)  # -inf (an edge that never binds) on both sides: 0
        g.terms = (g.wi.sum(axis=1), delta, [np.flatnonzero(delta[:, t] != 0.0) for t in (0, 1)])
    return g.terms


def _weights(g: Graph, keep: np.ndarray, e0: int, n: int) -> np.ndarray:
    """Edge weights (ms, edges x scenarios, plus a zero padding row): the typical terms, plus
    ``measured - typical`` where the owner is kept; only edges whose two values differ are looked up."""
    base, delta, rows = _weight_terms(g)
    W = np.empty((n + 1, keep.shape[1]))
    W[:-1] = base[e0:e0 + n, None]
    W[-1] = 0.0
    for t in (0, 1):
        lo, hi = np.searchsorted(rows[t], (e0, e0 + n))
        r = rows[t][lo:hi]
        if r.size:
            local = r - e0
            add = keep.take(g.own[r, t], axis=0) * delta[r, t, None]
            add += W.take(local, axis=0)
            W[local] = add
    return W


def simulate(g: Graph, masks: np.ndarray) -> np.ndarray:
    """T (ms, shape scenarios x blocks): each block's latest end of a rank's last op, per scenario.

    ``masks[s, owner]`` True: the owner's terms are as measured in scenario s, else typical; the
    last column (fixed) must be True. Values are node-major (a node's scenarios side by side)."""
    S, R = masks.shape[0], len(g.ranks)
    keep = np.ascontiguousarray(masks.T)
    bound = np.tile(g.first[:, None], (1, S))
    T = np.full((g.steps.size, S), np.nan)
    for b in range(g.steps.size):
        p = plan(g, b)
        e0 = g.edges[b]
        W = _weights(g, keep, e0, p.edges)
        V = np.empty((p.n + 1, S))
        V[:R] = bound
        V[p.n] = -np.inf
        for p0, pm, p1, src, edge, idx, wid in p.levels:
            if pm > p0:
                np.add(V.take(src, axis=0), W.take(edge, axis=0), out=V[p0:pm])
            if p1 > pm:
                both = V.take(idx, axis=0)
                both += W.take(wid, axis=0)
                np.maximum.reduce(both, axis=1, out=V[pm:p1])
        vals = V[p.exits]
        if vals.size:
            T[b] = vals.max(axis=0)
        bound[p.exit_ranks] = vals
    return T.T


SPLIT_MIN = 20_000_000
"""Scenario x node visits from which :func:`simulate_split` shares the scenarios with a forked copy of
this process (the 64-rank x 1,000-step run: 94 scenarios x 1.82 M nodes, 171 M)."""


def simulate_split(g: Graph, masks: np.ndarray) -> np.ndarray:
    """:func:`simulate`, with the second half of the scenarios simulated by a forked copy of this
    process while this one does the first (:func:`~otel_train.analysis.pools.beside_a_copy`: the graph
    of a large run, hundreds of MB, is inherited, never pickled), when the work reaches
    :data:`SPLIT_MIN` and a copy can be forked. Every scenario is simulated alone, column by column, so
    the values are the same either way. The plans and weight terms are made first, here, for both. A
    copy that fails has its half redone here (by ``beside_a_copy``)."""
    S = masks.shape[0]
    if S < 2 or S * int(g.nodes[-1]) < SPLIT_MIN or not can_fork():
        return simulate(g, masks)
    for b in range(g.steps.size):
        plan(g, b)
    _weight_terms(g)
    half = S // 2
    return np.concatenate(beside_a_copy(lambda: simulate(g, masks[:half]), lambda: simulate(g, masks[half:])))


def step_times(T: np.ndarray) -> np.ndarray:
    """Per scenario, each step's time (ms): ``T[b] - T[b-1]`` for every block but the first."""
    return np.diff(T, axis=-1)
