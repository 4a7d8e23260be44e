"""Matching a group's comm ops into joins (collectives, send/recv pairs) (docs/analysis.md "The
dependency graph")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from otel_train.analysis.graph_chain import Flat
from otel_train.analysis.graph_model import RESOLUTION_MS


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


