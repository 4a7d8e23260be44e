"""The comm graphs of a run as it is written (docs/comm.md), and the hosts' clocks estimated from them
(docs/clock.md).

Each poll adds the ops each process closed or waits in (:func:`~otel_train.analysis.comm.feed_process`,
as :func:`~otel_train.analysis.comm.build_graphs` does for a whole run), so a ``desync`` shows at the
poll that reads the second side of its seq; the clock is :func:`~otel_train.analysis.comm.run_clock`
of the processes followed, asked again at most every :data:`CLOCK_EVERY_S`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from otel_train.analysis.comm import CommGraph, CommOp, Group, feed_process, run_clock
from otel_train.analysis.live.members import GroupKey, ProcessKey
from otel_train.analysis.live.stragglers import RECENT_STEPS
from otel_train.analysis.spans import ProcessState, Run

PRUNE_EVERY_OPS = 200_000
"""A live comm graph drops what it needs no more (:meth:`CommGraph.prune`) each time this many more ops came."""
CLOCK_EVERY_S = 5.0
"""The hosts' clocks (docs/clock.md) are estimated again from the live graphs at most this often."""



class LiveGraphs:
    """The comm graph of each (source, attempt), with the ops of Flight Recorder dumps merged in."""

    def __init__(self) -> None:
        self.graphs: dict[GroupKey, CommGraph] = {}
        self._rows: dict[ProcessKey, int] = {}  # comm ops of each process already added
        self._pruned: dict[GroupKey, int] = {}  # graph.ops at each graph's last prune
        self._dumps: tuple[list[CommOp], list[Group]] = ([], [])

    @property
    def empty(self) -> bool:
        """Whether no process was added since the start or the last :meth:`reset`."""
        return not self._rows

    def reset(self) -> None:
        """Drop the graphs, to be made again (the processes' attempts were renumbered)."""
        self.graphs, self._rows = {}, {}

    def desyncs(self) -> int:
        """Groups found desynced, over all graphs."""
        return sum(len(g.desynced) for g in self.graphs.values())

    def feed(self, states: Mapping[ProcessKey, ProcessState]) -> None:
        """Add what each of these processes closed or waits in since it was last fed."""
        for key, state in states.items():
            graph = self.graphs.get((state.source, state.attempt))
            if graph is None:
                graph = self.graphs[(state.source, state.attempt)] = CommGraph(source=state.source, attempt=state.attempt)
                _add_dumps(graph, *self._dumps)
            self._rows[key] = feed_process(graph, state, self._rows.get(key, 0))

    def prune(self, states: Callable[[], Iterable[ProcessState]]) -> None:
        """Every :data:`PRUNE_EVERY_OPS` new ops of a graph, drop what is done before the last
        :data:`RECENT_STEPS` steps of its slowest process (kept: the steps the straggler rule looks at,
        and all that is open)."""
        for (source, attempt), graph in self.graphs.items():
            if graph.ops - self._pruned.get((source, attempt), 0) >= PRUNE_EVERY_OPS:
                self._pruned[(source, attempt)] = graph.ops
                steps = [s.final_step for s in states()
                         if (s.source, s.attempt) == (source, attempt) and s.final_step is not None]
                if steps:
                    graph.prune(min(steps) - RECENT_STEPS - 1)

    def add_dumps(self, ops: list[CommOp], groups: list[Group]) -> None:
        """Flight Recorder dumps read again: merged into every graph (and every graph made later)."""
        self._dumps = (ops, groups)
        for graph in self.graphs.values():
            _add_dumps(graph, ops, groups)


def _add_dumps(graph: CommGraph, ops: list[CommOp], groups: list[Group]) -> None:
    for op in ops:
        if op.attempt == graph.attempt:
            graph.add(op)
    for group in groups:
        graph.add_group(group, replace=False)


class LiveClock:
    """The hosts' clocks from the collectives seen so far, set on every graph: arrivals and "waiting
    since" compare aligned times. ``align=False`` (``--no-align``): raw clocks."""

    def __init__(self, align: bool) -> None:
        self.align = align
        self._ops = -1
        self._next = 0.0

    def update(self, graphs: dict[GroupKey, CommGraph], states: Callable[[], Iterable[ProcessState]],
               now: float) -> None:
        """Estimated again when new ops came, at most every :data:`CLOCK_EVERY_S` (``states``: the
        processes followed, asked only then)."""
        ops = sum(g.ops for g in graphs.values())
        if ops == self._ops or now < self._next or not graphs:
            return
        self._ops, self._next = ops, now + CLOCK_EVERY_S
        clock = run_clock(Run(list(states()), align=self.align), graphs)
        for graph in graphs.values():
            graph.clock = clock
