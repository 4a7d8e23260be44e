"""Matching a group's comm ops into joins (collectives, send/recv pairs) (docs/analysis.md "The
dependency graph")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from otel_train.analysis.graph_chain import Flat
from otel_train.analysis.graph_model import RESOLUTION_MS, WAIT_MS


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




WAIT_CANDIDATES = 16
"""Op ends looked at per gap (the latest ones in its window; ends of one collective tie, and any of them
will do)."""
WAIT_CHUNK = 100_000
"""Gaps matched at a time (at most ``WAIT_CANDIDATES`` pairs each: bounded memory on any run)."""


@dataclass(slots=True)
class Waits:
    """Items whose lead is a wait (docs/analysis.md "Waits"): the item, the node of the op end it waited
    for (before :func:`graph._edges` renumbers: a piece's item id, or ``ni + no + op`` for an op's end)
    and the item's start minus that end (ms, within the records' resolution of zero or positive)."""

    item: np.ndarray
    node: np.ndarray
    delta: np.ndarray


def waits(flat: Flat) -> Waits:
    """Untraced time (an item's lead) longer than :data:`WAIT_MS` that ends within :data:`WAIT_MS` after
    (or :data:`RESOLUTION_MS` before) another rank's op end in the same block is a wait on that op; the
    nearest such end is the one waited for. Candidates: pieces and comm ops (not detached ones: their end
    is when a recorder looked)."""
    prev = flat.i_prev
    lead = np.where(prev >= 0, flat.i_start - flat.i_end[np.maximum(prev, 0)], 0.0)
    gap = np.flatnonzero((prev >= 0) & (lead > WAIT_MS))
    ends = _ends(flat) if gap.size else ()
    parts = [_nearest(flat, gap[k:k + WAIT_CHUNK], ends) for k in range(0, gap.size, WAIT_CHUNK)]
    if not parts:
        return Waits(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0))
    return Waits(*(np.concatenate([p[k] for p in parts]) for k in range(3)))


def _ends(flat: Flat) -> tuple[np.ndarray, ...]:
    """(end, node, rank, block) of every op end a wait can end at, sorted by end."""
    ni, no = flat.i_start.size, flat.o_start.size
    pieces = np.flatnonzero(flat.i_piece >= 0)
    ops = np.flatnonzero(~flat.o_detached.astype(bool))
    end = np.concatenate([flat.i_end[pieces], flat.o_end[ops]])
    cols = (end, np.concatenate([pieces, ni + no + ops]),
            np.concatenate([flat.i_rank[pieces], flat.o_rank[ops]]).astype(np.int64),
            np.concatenate([flat.i_block[pieces], flat.i_block[flat.o_item[ops]]]))
    order = np.argsort(end, kind="stable")
    return tuple(c[order] for c in cols)


def _nearest(flat: Flat, gap: np.ndarray, ends: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """(item, node, delta) of the gaps ``gap`` that end at another rank's op end (:func:`waits`)."""
    c_end, c_node, c_rank, c_block = ends
    at = flat.i_start[gap]
    hi = np.searchsorted(c_end, at + RESOLUTION_MS, side="right")
    lo = np.maximum(np.searchsorted(c_end, at - WAIT_MS, side="left"), hi - WAIT_CANDIDATES)
    counts = np.maximum(hi - lo, 0)
    g = np.repeat(np.arange(gap.size), counts)
    c = np.repeat(hi - np.cumsum(counts), counts) + np.arange(int(counts.sum()))
    ok = (c_rank[c] != flat.i_rank[gap[g]].astype(np.int64)) & (c_block[c] == flat.i_block[gap[g]])
    g, c = g[ok], c[ok]
    pick = np.lexsort((np.abs(at[g] - c_end[c]), g))
    first = np.ones(pick.size, bool)
    first[1:] = g[pick][1:] != g[pick][:-1]
    g, c = g[pick][first], c[pick][first]
    return gap[g], c_node[c], at[g] - c_end[c]
