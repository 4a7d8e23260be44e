"""Reading the what-if graph's ops from a process: leaves and comm ops in ms on the reference clock
(docs/analysis.md "The dependency graph")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from otel_train import schema
from otel_train.analysis.clock import Clock
from otel_train.analysis.graph_model import P2P_KEY, UNTRACED, Window
from otel_train.analysis.spans import NO_STEP, ProcessState
from otel_train.analysis.stats import columns


NO_END = "no end time (unfinished, or a backend that did not time it)"
NO_SEQ = "no comm.seq (cannot be matched with the other members)"


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
    left_out: dict[str, int] = field(default_factory=dict)  # comm ops of the window not used: why -> how many




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


def _comm(d: ProcessState, names: Names, descs: dict[str, str], window: Window | None,
          left: dict[str, int]) -> list[np.ndarray]:
    """(start s, end s, step, name, key, send, tkey) of the process's comm ops (host and device clock);
    how many of the window's ops cannot be used, and why, into ``left``."""
    log = d.comm
    n = len(log)
    if n == 0:
        return [np.empty(0), np.empty(0)] + [np.empty(0, np.int64)] * 3 + [np.empty(0, bool), np.empty(0, np.int64)]
    start, end = np.frombuffer(log.start, np.float64), np.frombuffer(log.end, np.float64)
    seq, peer = np.frombuffer(log.seq, np.int64), np.frombuffer(log.peer, np.int64)
    nbytes, step = np.frombuffer(log.nbytes, np.int64), np.frombuffer(log.step, np.int64)
    codes = np.frombuffer(log.codes, np.uint32).reshape(-1, 6)
    s = log.strings
    # Device-clock ops take part like host ones (their times are the device's): docs/analysis.md "Device clocks".
    inside = _in_window(step, window)
    ok = inside & ~np.isnan(end) & (seq >= 0)
    left[NO_END] = int((inside & np.isnan(end)).sum())
    left[NO_SEQ] = int((inside & ~np.isnan(end) & (seq < 0)).sum())
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
    left: dict[str, int] = {}
    cs, ce, cstep, cname, ckey, csend, ctkey = _comm(d, names, descs, window, left)
    if synced[0].size:
        # No comm op: the last span of each sync phase per step is the collective (keyed by its step).
        cs, ce, cstep, cname = synced
        ckey = cstep + (1 << 61)
        csend = np.zeros(cs.size, bool)
        ctkey = np.array([names.tkey((f"sync:{n}", "", -1)) for n in cname.tolist()], np.int64)
    ms = [_to_ms(x, d, clock, shift, t0) for x in (ls, le, cs, ce)]
    return RankOps(ms[0], ms[1], lstep, lname, ms[2], ms[3], cstep, cname, ckey, csend, ctkey,
                   {k: v for k, v in left.items() if v})


