"""Synthetic runs with ``comm.*`` spans (docs/comm.md): what the recorder writes, op by op, on the
clocks a blocking collective gives (every member leaves it ``tail`` ms after the last one arrived)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from analysis_fixtures import Proc

from otel_train import schema
from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER, STEP

Times = Callable[[int, int], dict[str, float]]


def comm_attrs(group: str, seq: int, nbytes: int = 16, dtype: str = "float32", peer: int | None = None) -> dict:
    attrs = {schema.ATTR_COMM_GROUP: group, schema.ATTR_COMM_SEQ: seq, schema.ATTR_COMM_BYTES: nbytes,
             schema.ATTR_COMM_DTYPE: dtype, schema.ATTR_COMM_CLOCK: schema.COMM_CLOCK_HOST}
    if peer is not None:
        attrs[schema.ATTR_COMM_PEER] = peer
    return attrs


def declare(procs: Sequence[Proc], group: str = "0", desc: str = "default_pg", ranks: Sequence[int] | None = None,
            mesh: dict | None = None) -> None:
    """Each member writes the ``comm.group`` instant (and, with ``mesh(rank)``, its ``otel_train.mesh``)."""
    members = list(ranks) if ranks is not None else [p.rank for p in procs]
    for p in procs:
        if p.rank in members:
            p.instant(schema.INSTANT_COMM_GROUP, group=group, desc=desc, ranks=members)


def open_op(p: Proc, op: str, group: str, seq: int, **kw: object) -> None:
    p.start(schema.comm_span_name(op), **comm_attrs(group, seq, **kw))  # type: ignore[arg-type]


def collective(procs: Sequence[Proc], op: str, group: str, seq: int, tail: float = 2.0,
               sizes: dict[int, int] | None = None, ops: dict[int, str] | None = None,
               dtypes: dict[int, str] | None = None) -> None:
    """Every proc (already at its arrival time) issues the op; all leave ``tail`` ms after the last arrival."""
    for p in procs:
        open_op(p, (ops or {}).get(p.rank, op), group, seq, nbytes=(sizes or {}).get(p.rank, 16),
                dtype=(dtypes or {}).get(p.rank, "float32"))
    last = max(p.now_ms for p in procs)
    for p in procs:
        p.now_ms = last + tail
        p.end()


def base(rank: int, step: int) -> dict[str, float]:
    return {DATA_FETCH: 5.0, FORWARD: 20.0, BACKWARD: 30.0, OPTIMIZER: 5.0, "tail": 2.0}


def dp_steps(procs: Sequence[Proc], steps: range, times: Times = base, group: str = "0", accumulate: int = 1,
             seq0: int = 0) -> int:
    """Data-parallel steps: ``accumulate`` × (data_fetch, forward, backward), the last backward holding
    the gradient all_reduce (seq counted from ``seq0``), then optimizer. Returns the next seq."""
    seq = seq0
    for s in steps:
        t = {p.rank: times(p.rank, s) for p in procs}
        for p in procs:
            p.set_step(s)
            p.start(STEP)
        for micro in range(accumulate):
            for p in procs:
                for name in (DATA_FETCH, FORWARD):
                    p.start(name)
                    p.advance(t[p.rank][name])
                    p.end()
                p.start(BACKWARD)
                p.advance(t[p.rank][BACKWARD])
            if micro == accumulate - 1:
                collective(procs, "all_reduce", group, seq, t[procs[0].rank]["tail"])
                seq += 1
            for p in procs:
                p.end()
        for p in procs:
            p.start(OPTIMIZER)
            p.advance(t[p.rank][OPTIMIZER])
            p.end()
            p.end()
    return seq
