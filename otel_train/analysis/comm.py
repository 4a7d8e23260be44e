"""The communication graph: every rank's ``comm.*`` ops, matched across ranks (docs/comm.md).

* a collective is one op of one process group: the members' ops with the same ``comm.group`` and
  ``comm.seq`` are the same collective;
* a p2p op is matched by its pair and number: the k-th send from A to B is the k-th recv on B from A
  (both carry ``comm.seq`` = k);
* an op's start is when its rank arrived (issued it); its end is when it finished for that rank;
  an op without an end is a rank waiting in it (open);
* ops come from the trace files (``comm.*`` spans) and from Flight Recorder dumps; an op both
  sources saw is one op (the trace's times win, the dump fills what the trace lacks);
* the groups and their members come from the ``comm.group`` instants (or a dump's ``pg_config``);
  the mesh from ``otel_train.mesh`` instants.

Status: the data types below are the interface the findings, the Flight Recorder reader and the
exporters share; :func:`build_graph` is filled in by the span-model work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCE_TRACE = "trace"
SOURCE_FR = "flight_recorder"


@dataclass(frozen=True, slots=True)
class CommOp:
    """One rank's view of one communication op.

    ``start``/``end`` are the rank's own (host) clock in Unix seconds; ``end`` is None while the rank
    waits in it. ``peer`` is the other side's global rank for send/recv, else None. ``span_id`` is
    the trace span's id (None for an op only a dump saw). ``state`` is Flight Recorder's
    (``scheduled``, ``started``, ``completed``) or ``ok``/``error``/``open``/``incomplete`` from the trace.
    """

    rank: int
    attempt: int
    group: str
    seq: int
    op: str
    start: float | None
    end: float | None = None
    peer: int | None = None
    nbytes: int | None = None
    dtype: str | None = None
    step: int | None = None
    span_id: str | None = None
    tid: int | None = None
    state: str = "ok"
    source: str = SOURCE_TRACE
    clock: str = "host"

    @property
    def waiting(self) -> bool:
        """Still inside the op (no end): the rank waits in it."""
        return self.end is None


@dataclass(frozen=True, slots=True)
class Group:
    """A process group: its id, what it is for (``default_pg``, ``dp``, ``pp``, ``tp``) and its members'
    global ranks in group order."""

    group: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(slots=True)
class CommGraph:
    """Every op of a run, matched: ``collectives[(group, seq)]`` holds each member's op (by rank);
    ``p2p[(src, dst, seq)]`` the send (``[0]``) and the recv (``[1]``), either None when unseen."""

    groups: dict[str, Group] = field(default_factory=dict)
    collectives: dict[tuple[str, int], dict[int, CommOp]] = field(default_factory=dict)
    p2p: dict[tuple[int, int, int], list[CommOp | None]] = field(default_factory=dict)
    mesh: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)  # rank -> dim -> (size, index)
