"""One clock for many hosts: each host's offset and drift against the reference host (docs/clock.md).

Every record's ``ts`` is its host's wall clock. A blocking collective (``all_reduce``,
``all_gather``, ``reduce_scatter``, ``all_to_all``, ``barrier``) is a clock-sync event: every member
leaves it within microseconds of the others, so the difference between two hosts' end times of one
collective is the difference between their clocks. :func:`estimate` turns those differences into
one line per host, ``host clock - reference clock = offset + drift x (t - t0)``:

* per collective and host, the earliest end among the host's members (a member descheduled at the
  wrong moment leaves late, never early); device-clock ops (``comm.clock: device``) are compared
  with device-clock ops only; p2p, rooted ops (broadcast, reduce, gather, scatter), failed ops and
  ops without a duration (a dump's op whose end is unknown) are no samples;
* per pair of hosts (the collective's lowest host against each other one), a robust line fit: a
  Theil-Sen start on at most 64 samples, then least squares trimmed to 5 robust deviations
  (at least 50 us) a few times; the drift only when the samples span 20 s, there are 8, and it
  is at least 3 standard errors from zero (else the offset alone);
* then causality: no member leaves a collective before the last one arrived, so at every collective
  ``first arrival on one host - last departure on the other`` bounds the offset from below and
  ``first departure - last arrival`` from above; the line is moved (not tilted) into those bounds
  when they agree (a host whose ranks always leave a little later is not mistaken for a clock);
* hosts that share no collective with the reference host are reached through others (the pairs
  with the most samples first); a host reached by none keeps its own clock (:meth:`Clock.domain`).

:class:`Clock` answers every reader (the comm graph's arrivals and "waiting since", whatif,
export, watch): :meth:`Clock.align` maps a host's time to the reference clock. This module imports
no other part of the analysis (the comm graph imports it).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from otel_train import schema

if TYPE_CHECKING:
    from otel_train.analysis.comm import CommGraph

SYNC_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
"""Ops every member leaves together (a rooted op's root may leave before the others receive)."""
SKEW_MS = 10.0
"""A host off the reference by more than this (at any time of the run) is a ``clock_skew`` finding."""
DRIFT_MIN_SPAN_S = 20.0
DRIFT_MIN_SAMPLES = 8
TRIM_SIGMAS = 5.0
TRIM_FLOOR_S = 50e-6
TRIM_ROUNDS = 4
THEIL_SEN_POINTS = 64
_FAILED = frozenset({schema.STATUS_ERROR, schema.STATUS_INCOMPLETE})


@dataclass(frozen=True, slots=True)
class HostClock:
    """One host against the reference: ``offset_s`` ahead at ``t0``, ``drift`` (s per s) faster;
    ``residual_s`` the 99th percentile of the kept samples' distance to the line, ``samples`` how many."""

    host: str
    offset_s: float
    drift: float
    residual_s: float
    samples: int

    def row(self) -> dict[str, Any]:
        """The ``summarize --json`` ``clock`` row."""
        return {"host": self.host, "offset_ms": self.offset_s * 1e3, "drift_ppm": self.drift * 1e6,
                "residual_ms": self.residual_s * 1e3, "samples": self.samples}


@dataclass(slots=True)
class Clock:
    """The hosts' clocks of a run. ``hosts`` holds the estimated ones (the reference among them, at
    zero); ``raw``: nothing is aligned and every host counts as one clock (``--no-align``)."""

    t0: float = 0.0
    reference: str | None = None
    hosts: dict[str, HostClock] = field(default_factory=dict)
    raw: bool = False
    span_s: float = 0.0  # reference time from t0 to the last sample

    @property
    def applied(self) -> bool:
        """Whether any time is moved (more than the reference host was estimated)."""
        return not self.raw and len(self.hosts) > 1

    def domain(self, host: str | None) -> str | None:
        """Hosts whose times compare with each other's share a domain: all of them in raw mode, every
        estimated host (the reference's domain), else each host its own."""
        if self.raw or host in self.hosts:
            return self.reference
        return host

    def align(self, host: str | None, t: float | None) -> float | None:
        """``t`` of ``host``'s clock on the reference clock (unchanged for a host not estimated)."""
        hc = self.hosts.get(host) if host is not None and not self.raw else None  # type: ignore[arg-type]
        if hc is None or t is None or (hc.offset_s == 0.0 and hc.drift == 0.0):
            return t
        return (t - hc.offset_s + hc.drift * self.t0) / (1.0 + hc.drift)

    def to_host(self, host: str | None, t: float | None) -> float | None:
        """The inverse of :meth:`align`: reference time ``t`` on ``host``'s clock."""
        hc = self.hosts.get(host) if host is not None and not self.raw else None  # type: ignore[arg-type]
        if hc is None or t is None:
            return t
        return t + hc.offset_s + hc.drift * (t - self.t0)

    def shift(self, host: str | None, t: float | None) -> float:
        """What :meth:`align` subtracts from ``t`` (0 for a host not estimated)."""
        return 0.0 if t is None else t - (self.align(host, t) or 0.0)

    def align_many(self, hosts: Sequence[str | None], ts: np.ndarray) -> np.ndarray:
        """:meth:`align` of each column ``j`` of ``ts`` (or each element of a 1-d array) by ``hosts[j]``."""
        out = np.array(ts, dtype=float, copy=True)
        for j, host in enumerate(hosts):
            hc = self.hosts.get(host) if host is not None and not self.raw else None  # type: ignore[arg-type]
            if hc is not None:
                out[..., j] = (out[..., j] - hc.offset_s + hc.drift * self.t0) / (1.0 + hc.drift)
        return out

    def rows(self) -> list[dict[str, Any]]:
        """``summarize --json``'s ``clock``: empty unless more than one host was estimated."""
        if not self.applied:
            return []
        return [self.hosts[h].row() for h in sorted(self.hosts, key=lambda h: (h != self.reference, h))]

    def skewed(self) -> list[HostClock]:
        """Hosts off the reference by more than :data:`SKEW_MS` at the start or the end of the run."""
        if not self.applied:
            return []
        return [hc for hc in self.hosts.values()
                if max(abs(hc.offset_s), abs(hc.offset_s + hc.drift * self.span_s)) * 1e3 > SKEW_MS]

    def metadata(self) -> dict[str, Any]:
        """What an export says it applied (the trace's metadata)."""
        return {"aligned": self.applied, "reference": self.reference, "t0": self.t0,
                "hosts": self.rows() if self.applied else []}


def raw_clock() -> Clock:
    """Nothing aligned (``--no-align``)."""
    return Clock(raw=True)


def estimate(graphs: Iterable[CommGraph], t0: float | None = None) -> Clock:
    """The hosts' clocks from the blocking collectives of ``graphs`` (every attempt of a run: a host's
    clock is the machine's); ``t0``: the run's first record (default: the first sample). One host (or
    none) costs a look at the graphs' host maps only."""
    graphs = list(graphs)
    hosts: dict[int, str] = {}
    for g in graphs:
        hosts.update({r: h for r, h in g.hosts.items() if h is not None})
    names = sorted(set(hosts.values()))
    if len(names) < 2:
        return Clock(t0=t0 or 0.0, reference=names[0] if names else None)
    reference = hosts[min(hosts)]
    order = [reference, *(h for h in names if h != reference)]
    index = {h: i for i, h in enumerate(order)}
    rank_host = np.full(max(hosts) + 1, -1, dtype=np.int64)
    for r, h in hosts.items():
        rank_host[r] = index[h]
    coll, host, end, arrive = _samples(graphs, rank_host)
    if end.size == 0:
        return Clock(t0=t0 or 0.0, reference=reference)
    start = float(end.min()) if t0 is None else t0
    edges = _edges(coll, host, end, arrive, start)
    fitted = {key: _fit(*e) for key, e in edges.items()}
    clocks = _chain(fitted, len(order))
    out = {order[i]: HostClock(order[i], *c) for i, c in clocks.items()}
    return Clock(t0=start, reference=reference, hosts=out, span_s=max(0.0, float(end.max()) - start))


def _samples(graphs: Sequence[CommGraph], rank_host: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(collective id, host index, end, start) of every op that can be a sample. Device-clock ops
    form collectives of their own."""
    ranks: list[int] = []
    ends: list[float] = []
    starts: list[float] = []
    colls: list[int] = []
    cid = 0
    for g in graphs:
        for ops in g.collectives.values():
            if len(ops) < 2 or next(iter(ops.values())).op not in SYNC_OPS:
                continue
            for op in ops.values():
                if op.end is None or op.state in _FAILED or (op.start is not None and op.end <= op.start):
                    continue
                ranks.append(op.rank)
                ends.append(op.end)
                starts.append(op.end if op.start is None else op.start)
                colls.append(2 * cid + (op.clock == schema.COMM_CLOCK_DEVICE))
            cid += 1
    r = np.asarray(ranks, dtype=np.int64)
    ok = r < rank_host.size
    host = np.where(ok, rank_host[np.minimum(r, rank_host.size - 1)], -1)
    keep = host >= 0
    return (np.asarray(colls, dtype=np.int64)[keep], host[keep], np.asarray(ends, dtype=float)[keep],
            np.asarray(starts, dtype=float)[keep])


Edge = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _edges(coll: np.ndarray, host: np.ndarray, end: np.ndarray, arrive: np.ndarray, t0: float
           ) -> dict[tuple[int, int], Edge]:
    """Per (anchor host, host): elapsed times, end differences and the causal bounds (low, high) of
    each collective. The anchor of a collective is its lowest host (the reference when it is a
    member); each host's sample is its members' earliest end, its last arrival the latest start."""
    order = np.lexsort((end, host, coll))
    coll, host, end, arrive = coll[order], host[order], end[order], arrive[order]
    first = np.ones(coll.size, dtype=bool)
    first[1:] = (coll[1:] != coll[:-1]) | (host[1:] != host[:-1])
    last_start = np.maximum.reduceat(arrive, np.flatnonzero(first)) if coll.size else arrive
    coll, host, end = coll[first], host[first], end[first]
    starts = np.ones(coll.size, dtype=bool)
    starts[1:] = coll[1:] != coll[:-1]
    anchor_row = np.maximum.accumulate(np.where(starts, np.arange(coll.size), 0))
    a_host, a_end, a_last = host[anchor_row], end[anchor_row], last_start[anchor_row]
    other = ~starts
    width = int(host.max()) + 1 if host.size else 1
    key = a_host[other] * width + host[other]
    x, y = a_end[other] - t0, end[other] - a_end[other]
    low, high = last_start[other] - a_end[other], end[other] - a_last[other]
    out: dict[tuple[int, int], Edge] = {}
    if key.size == 0:
        return out
    by = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[by])) + 1
    parts = [np.split(v[by], cuts) for v in (x, y, low, high)]
    for k, *e in zip(key[by][np.r_[0, cuts]], *parts):
        out[(int(k) // width, int(k) % width)] = tuple(e)  # type: ignore[assignment]
    return out


def _fit(x: np.ndarray, y: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[float, float, float, int]:
    """Robust ``y = offset + drift x`` moved into the causal bounds: (offset, drift, p99 |residual| of
    the kept samples, kept)."""
    offset, drift, keep = _trimmed_line(x, y)
    lo, hi = float(np.max(low - drift * x)), float(np.min(high - drift * x))
    if lo <= hi:  # the bounds agree (honest records): the line must lie within them
        offset = min(max(offset, lo), hi)
    r = np.abs(y[keep] - offset - drift * x[keep])
    return offset, drift, float(np.quantile(r, 0.99)) if r.size else 0.0, int(keep.sum())


def _trimmed_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Theil-Sen start, then least squares trimmed to :data:`TRIM_SIGMAS`; the drift kept only when
    significant (3 standard errors)."""
    use_drift = y.size >= DRIFT_MIN_SAMPLES and float(np.ptp(x)) >= DRIFT_MIN_SPAN_S
    drift = _theil_sen(x, y) if use_drift else 0.0
    offset = float(np.median(y - drift * x))
    keep = np.ones(y.size, dtype=bool)
    for _ in range(TRIM_ROUNDS):
        r = y - offset - drift * x
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        new = np.abs(r) <= max(TRIM_SIGMAS * scale, TRIM_FLOOR_S)
        if new.sum() < 2:
            break
        keep = new
        if use_drift and float(np.ptp(x[keep])) > 0.0:
            xm, ym = float(x[keep].mean()), float(y[keep].mean())
            dx = x[keep] - xm
            drift = float(np.dot(dx, y[keep] - ym) / np.dot(dx, dx))
            offset = ym - drift * xm
        else:
            offset = float(np.mean(y[keep]))
    if use_drift and keep.sum() > 2:
        dx = x[keep] - float(x[keep].mean())
        r = y[keep] - offset - drift * x[keep]
        se = float(np.sqrt(np.dot(r, r) / (r.size - 2) / max(float(np.dot(dx, dx)), 1e-300)))
        if abs(drift) < 3.0 * se:
            drift, offset = 0.0, float(np.mean(y[keep]))
    return offset, drift, keep


def _theil_sen(x: np.ndarray, y: np.ndarray) -> float:
    """The median pairwise slope over at most :data:`THEIL_SEN_POINTS` samples spread over ``x``."""
    pick = np.unique(np.linspace(0, x.size - 1, min(x.size, THEIL_SEN_POINTS)).astype(np.int64))
    order = np.argsort(x, kind="stable")[pick]
    xs, ys = x[order], y[order]
    i, j = np.triu_indices(xs.size, 1)
    dx = xs[j] - xs[i]
    ok = dx > 0
    return float(np.median((ys[j] - ys[i])[ok] / dx[ok])) if ok.any() else 0.0


def _chain(fitted: Mapping[tuple[int, int], tuple[float, float, float, int]], n: int
           ) -> dict[int, tuple[float, float, float, int]]:
    """Each host reached from the reference (index 0) through the fitted pairs, the best supported
    first (a widest-path tree): offsets and drifts add along the path, residuals too; samples are the
    path's fewest. The reference itself: zeros, with the most samples of its pairs."""
    links: dict[int, list[tuple[int, int, float, float, float]]] = {}
    for (a, b), (off, drift, res, k) in fitted.items():
        links.setdefault(a, []).append((b, k, off, drift, res))
        links.setdefault(b, []).append((a, k, -off, -drift, res))
    best0 = max((k for _, k, *_ in links.get(0, [])), default=0)
    out: dict[int, tuple[float, float, float, int]] = {0: (0.0, 0.0, 0.0, best0)}
    heap = [(-k, 0, b, off, drift, res) for b, k, off, drift, res in links.get(0, [])]
    heapq.heapify(heap)
    while heap and len(out) < n:
        negk, a, b, off, drift, res = heapq.heappop(heap)
        if b in out:
            continue
        base = out[a]
        k = min(-negk, base[3]) if a != 0 else -negk
        out[b] = (base[0] + off, base[1] + drift, base[2] + res, k)
        for c, kc, oc, dc, rc in links.get(b, []):
            if c not in out:
                heapq.heappush(heap, (-min(kc, k), b, c, oc, dc, rc))
    return out
