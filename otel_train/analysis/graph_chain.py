"""One rank's chain of items (pieces of its leaves cut by its comm clusters), and every rank's chains
flattened into global columns (docs/analysis.md "The dependency graph")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otel_train.analysis.graph_model import P2P_KEY, RESOLUTION_MS, SNAP_MS, group_median
from otel_train.analysis.graph_ops import RankOps


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
    snapped: int = 0  # comm ops whose overlap with a neighbour (at most SNAP_MS) was snapped


def snap(ls: np.ndarray, le: np.ndarray, ro: RankOps) -> int:
    """Snap the rank's comm ops (in place) where they overlap a neighbour by more than the records'
    resolution and at most :data:`SNAP_MS` (times from CUDA events on several streams): an op that
    began just before the leaf it follows ended starts at that end; one that began just before the comm
    op before it ended, at that end; one that ended just after the next leaf began, ends there. ``ls``,
    ``le``: the serialised leaves, sorted. Returns how many ops were moved."""
    cs, ce = ro.c_start, ro.c_end
    if cs.size == 0:
        return 0
    moved = np.zeros(cs.size, bool)
    if ls.size:
        i = np.searchsorted(ls, cs, side="right") - 1
        tail = np.where(i >= 0, le[np.maximum(i, 0)], -np.inf)
        # begun in the last SNAP_MS of a leaf and ended after it (an op of a child span ends with the leaf)
        fix = (tail > cs + RESOLUTION_MS) & (tail - cs <= SNAP_MS) & (ce > tail + RESOLUTION_MS)
        cs[fix], moved[fix] = tail[fix], True
    order = np.argsort(cs, kind="stable")
    reach = np.concatenate([[-np.inf], np.maximum.accumulate(ce[order])[:-1]])
    s_o, e_o = cs[order], ce[order]
    fix = (reach > s_o + RESOLUTION_MS) & (reach - s_o <= SNAP_MS) & (e_o > reach + RESOLUTION_MS)
    cs[order[fix]], moved[order[fix]] = reach[fix], True
    if ls.size:
        nxt = np.searchsorted(ls, cs, side="right")
        head = np.where(nxt < ls.size, ls[np.minimum(nxt, ls.size - 1)], np.inf)
        fix = (ce > head + RESOLUTION_MS) & (ce - head <= SNAP_MS)
        ce[fix], moved[fix] = head[fix], True
    return int(moved.sum())


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
    snapped = snap(ls, le, ro)
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
                 np.concatenate([piece, np.full(cl_s.size, -1)])[items], where[ps.size + of], order, detached, waiter,
                 snapped)



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


