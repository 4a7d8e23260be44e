"""The query views' rows, from the one model (docs/query.md, "Views").

:func:`record_tables` turns a :class:`.load.Loaded` run into ``spans``, ``instants`` and ``scalars``
from each process's columns; :func:`model_tables` makes ``comm`` from the run's comm graphs
(``Run.comm``: the ops matched across ranks), and ``processes``, ``findings`` and ``clock`` from the
``summarize`` object itself. Times are moved onto the reference clock by the run's clock estimate
(docs/clock.md); ``raw_*`` columns keep each record's own. ``steps`` is made from ``spans`` by SQL
(:mod:`.engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from otel_train.analysis.clock import Clock
from otel_train.analysis.comm import CommGraph, CommOp
from otel_train.analysis.query.columns import NULL_INT, _json
from otel_train.analysis.query.load import Loaded
from otel_train.analysis.spans import Run

Columns = dict[str, Any]


def run_clock_of(run: Run) -> Clock:
    """The clock every graph of the run shares (no alignment when there is none)."""
    return next((g.clock for g in run.comm.values() if g.clock is not None), Clock())


def _aligned(clock: Clock, host: str | None, ts: np.ndarray) -> np.ndarray:
    return clock.align_many([host], ts.reshape(-1, 1)).reshape(-1)


def _concat(loaded: Loaded, view: str, clock: Clock, times: dict[str, str]) -> Columns:
    """One view's columns over every process: the process's identity repeated, its own columns, and
    each ``times`` column (aligned name -> raw name) moved onto the reference clock."""
    parts: dict[str, list[np.ndarray]] = {}
    for state, cols in zip(loaded.run.processes, loaded.columns):
        own = cols[view]
        n = len(next(iter(own.values()))) if own else 0
        ident = {"rank": np.full(n, state.rank, dtype=np.int64), "attempt": np.full(n, state.attempt, dtype=np.int64),
                 "host": np.full(n, state.host, dtype=object), "source": np.full(n, state.source, dtype=object)}
        aligned = {name: _aligned(clock, state.host, own[raw]) for name, raw in times.items()}
        for name, col in {**ident, **aligned, **own}.items():
            parts.setdefault(name, []).append(col)
    return {name: np.concatenate(cols) for name, cols in parts.items()}


def span_table(loaded: Loaded, clock: Clock) -> Columns:
    out = _concat(loaded, "spans", clock, {"start_ts": "raw_start_ts", "end_ts": "raw_end_ts"})
    if out:
        out["dur_ms"] = (out["end_ts"] - out["start_ts"]) * 1000.0
    return out


def _arrivals(graph: CommGraph) -> Iterator[tuple[list[CommOp], int]]:
    """Each op of the graph with its fellow members' ops (a collective's, or a send and its recv) and
    how many members it has."""
    for (group, _), ops in graph.collectives.items():
        members = graph.members(group)
        yield list(ops.values()), max(len(members), len(ops))
    for pair in graph.p2p.values():
        yield [op for op in pair if op is not None], 2


def _comm_rows(graph: CommGraph, clock: Clock) -> Iterator[tuple[Any, ...]]:
    """One row per op and member: arrival and end on the reference clock, the wait for the last member
    and the transfer after it (both null while a member has not arrived, or the op has not ended)."""
    def at(op: CommOp, t: float | None) -> float | None:
        return clock.align(graph.hosts.get(op.rank), t)

    for ops, size in _arrivals(graph):
        arrive = [at(op, op.start) for op in ops]
        complete = len(ops) >= size and all(a is not None for a in arrive)
        last = max(arrive) if complete else None  # type: ignore[type-var]
        for op, a in zip(ops, arrive):
            end = at(op, op.end)
            yield (op.rank, graph.attempt, graph.source, op.step, op.group, graph.desc(op.group), op.seq, op.op,
                   op.peer, op.nbytes, op.dtype, a, end, op.start, None if last is None or a is None else (last - a) * 1e3,
                   None if last is None or end is None else (end - last) * 1e3, last is not None and a == last,
                   op.state, op.span_id, op.phase, op.clock, op.source)


COMM_COLUMNS = ("rank", "attempt", "source", "step", "group", "desc", "seq", "op", "peer", "bytes", "dtype",
                "arrive_ts", "end_ts", "raw_arrive_ts", "wait_ms", "transfer_ms", "last_arrival", "status", "span_id",
                "phase", "clock", "from")
_COMM_INT = {"rank", "attempt", "step", "seq", "peer", "bytes"}
_COMM_FLOAT = {"arrive_ts", "end_ts", "raw_arrive_ts", "wait_ms", "transfer_ms"}


def _typed(name: str, values: list[Any], ints: set[str], floats: set[str], bools: set[str] = frozenset()  # type: ignore[assignment]
           ) -> np.ndarray:
    if name in ints:
        return np.array([NULL_INT if v is None else int(v) for v in values], dtype=np.int64)
    if name in floats:
        return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    if name in bools:
        return np.array([bool(v) for v in values], dtype=bool)
    return np.array(values, dtype=object)


def comm_table(run: Run, clock: Clock) -> Columns:
    rows = sorted((r for g in run.comm.values() for r in _comm_rows(g, clock)),
                  key=lambda r: (r[1], r[4] or "", r[6], r[0]))
    cols = list(zip(*rows)) if rows else [() for _ in COMM_COLUMNS]
    return {name: _typed(name, list(col), _COMM_INT, _COMM_FLOAT, {"last_arrival"})
            for name, col in zip(COMM_COLUMNS, cols)}


def dict_table(rows: list[dict[str, Any]], spec: dict[str, str]) -> Columns:
    """Rows of a ``summarize --json`` list as columns: ``spec`` names each column's kind (``int``,
    ``float``, ``bool``, ``str``, ``json``)."""
    memo: dict[bytes, str] = {}
    pick: dict[str, Callable[[Any], Any]] = {
        "int": lambda v: NULL_INT if v is None or isinstance(v, bool) or not isinstance(v, int) else v,
        "float": lambda v: np.nan if v is None else float(v),
        "bool": bool,
        "str": lambda v: None if v is None else str(v),
        "json": lambda v: _json(v, memo) if v not in (None, {}, []) else ("[]" if v == [] else None),
    }
    dtypes = {"int": np.int64, "float": np.float64, "bool": bool, "str": object, "json": object}
    return {name: np.array([pick[kind](r.get(name)) for r in rows], dtype=dtypes[kind]) for name, kind in spec.items()}


PROCESS_SPEC = {"rank": "int", "attempt": "int", "source": "str", "host": "str", "pid": "int", "world_size": "int",
                "final_step": "int", "relative_step": "int", "last_event": "str", "last_ts": "float",
                "open_spans": "json", "ended_cleanly": "bool", "signal": "str", "records": "int"}
FINDING_SPEC = {"kind": "str", "rank": "int", "attempt": "int", "step": "int", "phase": "str", "message": "str",
                "victims": "json", "comm": "json", "detail": "json"}
CLOCK_SPEC = {"host": "str", "offset_ms": "float", "drift_ppm": "float", "residual_ms": "float", "samples": "int"}


def summary_tables(summary: dict[str, Any]) -> dict[str, Columns]:
    """``processes``, ``findings`` and ``clock`` from the ``summarize --json`` object."""
    found = [{**f, "detail": f} for f in summary["findings"]]
    return {"processes": dict_table(summary["processes"], PROCESS_SPEC),
            "findings": dict_table(found, FINDING_SPEC),
            "clock": dict_table(summary["clock"], CLOCK_SPEC)}


def record_tables(loaded: Loaded) -> dict[str, Columns]:
    """The ``records`` group's columns: ``spans``, ``instants``, ``scalars`` (``steps`` is made from
    ``spans`` by SQL)."""
    clock = run_clock_of(loaded.run)
    return {"spans": span_table(loaded, clock),
            "instants": _concat(loaded, "instants", clock, {"ts": "raw_ts"}),
            "scalars": _concat(loaded, "scalars", clock, {"ts": "raw_ts"})}


def model_tables(run: Run, summary: dict[str, Any]) -> dict[str, Columns]:
    """The ``model`` group's columns: ``comm`` from the run's comm graphs, and ``processes``,
    ``findings``, ``clock`` from its ``summarize`` object."""
    return {"comm": comm_table(run, run_clock_of(run)), **summary_tables(summary)}
