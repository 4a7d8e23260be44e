"""Simulating a what-if graph: every scenario's step times at once, level by level (docs/analysis.md
"The dependency graph", Simulation)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otel_train.analysis.graph_model import JOIN, Graph
from otel_train.analysis.pools import beside_a_copy, can_fork


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
