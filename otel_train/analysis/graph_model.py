"""The what-if dependency graph's data: :class:`Graph`, the constants its modules share, and the group
statistics (means, medians) its typical values use (docs/analysis.md "The dependency graph")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


SNAP_MS = 0.2
"""Device-stream tolerance: a comm op that overlaps its rank's next or previous op (a span, another comm
op) by at most this much is snapped to it (timestamps from CUDA events on several streams overlap by
3-15 us comm/compute and up to 0.14 ms comm/comm): never a detached op, a cluster or untraced time."""
WAIT_MS = 0.05
"""A rank's untraced time longer than this that ends within this of another rank's op end (and no
later than the records' resolution after it) is a wait on that op (docs/analysis.md "Waits")."""

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
    waits: int = 0  # items whose lead is a wait on another rank's op (graph_joins.waits)
    snapped: int = 0  # comm ops snapped to a neighbour they overlapped by at most SNAP_MS
    left_out: dict[str, int] = field(default_factory=dict)  # comm ops of the window not used: why -> how many

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



def unsynchronized(early_ms: np.ndarray) -> dict[str, float] | None:
    """None when the ops synchronise their members; else ``{"share", "early_ms"}``: the share of
    them whose member ended more than :data:`UNSYNCED_SLACK_MS` before the last arrival (over
    :data:`UNSYNCED_SHARE`), and the median of how early."""
    early = early_ms[early_ms > UNSYNCED_SLACK_MS]
    share = early.size / early_ms.size if early_ms.size else 0.0
    return {"share": share, "early_ms": float(np.median(early))} if share > UNSYNCED_SHARE else None



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


