"""The straggler rule asked live (docs/watch.md): every :data:`STRAGGLERS_EVERY_S` over each running
group's last :data:`RECENT_STEPS` steps, and once when the group has finished; in a worker thread, so
reading goes on meanwhile."""

from __future__ import annotations

import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from otel_train.analysis.comm import CommGraph
from otel_train.analysis.findings import straggler_findings
from otel_train.analysis.live.members import GroupKey
from otel_train.analysis.live.process import WatchedProcess
from otel_train.analysis.spans import PhaseSeries, ProcessState

STRAGGLERS_EVERY_S = 30.0
"""The straggler rule is asked this often per running group (no single record changes its answer)."""
STRAGGLER_COST_FACTOR = 20.0
"""... or every this many times what asking it took, if that is longer (it costs ~2 ms per rank)."""
RECENT_STEPS = 50
"""The straggler rule looks at a group's last this many steps."""
SPANS_PER_STEP = 16
"""Spans of one name per step the recent-steps view allows for (more: its window holds fewer steps)."""

Ask = tuple[list[ProcessState], tuple[int, int], CommGraph | None]
"""One group's question: its recent-steps views, the steps (first, last), its recent comm graph."""


class StragglerAsks:
    """When to ask the straggler rule of each group, and the one ask in flight. ``background``: in a
    worker thread (its answer comes a poll or more later; :meth:`close` stops it)."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self._pool: ThreadPoolExecutor | None = None
        self._job: tuple[Future[list[dict[str, Any]]], list[GroupKey], float] | None = None
        self._next: dict[GroupKey, float] = {}
        self._final: set[GroupKey] = set()

    @property
    def busy(self) -> bool:
        """Whether an ask has not been collected yet (:meth:`result`)."""
        return self._job is not None

    def due(self, groups: dict[GroupKey, list[WatchedProcess]], now: float) -> list[GroupKey]:
        """The groups to ask now: every :data:`STRAGGLERS_EVERY_S` while a group runs, and once more
        when it has finished."""
        return [key for key, group in groups.items() if self._due(key, group, now)]

    def _due(self, key: GroupKey, group: list[WatchedProcess], now: float) -> bool:
        if all(lp.finished for lp in group):
            if key in self._final:
                return False
            self._final.add(key)
            return True
        return now >= self._next.get(key, 0.0)

    def ask(self, groups: dict[GroupKey, list[WatchedProcess]], due: list[GroupKey],
            graphs: dict[GroupKey, CommGraph], order: list[str]) -> None:
        """Ask the rule over each due group's last :data:`RECENT_STEPS` steps, on private recent-steps
        views (``order``: the run's phase order)."""
        asks: list[Ask] = []
        for key in due:
            states = [lp.state for lp in groups[key]]
            last = max((s.final_step for s in states if s.final_step is not None), default=None)
            if last is not None:
                first = last - RECENT_STEPS + 1
                graph = graphs.get(key)
                recent = graph.recent(first) if graph is not None and graph.ops else None
                asks.append(([recent_view(s, first) for s in states], (first, last), recent))
        work = partial(_straggler_work, asks, order)
        if self.background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="otel-train-stragglers")
            future = self._pool.submit(work)
        else:
            future = Future()
            future.set_result(work())
        self._job = (future, due, time.perf_counter())

    def result(self, now: float) -> tuple[list[dict[str, Any]], list[GroupKey]] | None:
        """The findings of a finished ask and the groups it judged (the next ask of each scheduled);
        None while none has finished."""
        if self._job is None or not self._job[0].done():
            return None
        future, due, began = self._job
        self._job = None
        # Its cost grows with the ranks (about 2 ms each): asked less often, it stays near 5 % of a core.
        took = time.perf_counter() - began
        for key in due:
            self._next[key] = now + max(STRAGGLERS_EVERY_S, STRAGGLER_COST_FACTOR * took)
        return future.result(), due

    def close(self) -> None:
        """Stop an ask still running (its result is not wanted any more)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _straggler_work(asks: list[Ask], order: list[str]) -> list[dict[str, Any]]:
    return [f for states, window, graph in asks for f in straggler_findings(states, order, window, graph)]


def recent_view(state: ProcessState, first_step: int) -> ProcessState:
    """A view of ``state`` with only what the straggler rule reads (phases, parents, host) for steps from
    ``first_step`` on, so asking it costs the same at step 100 and at step 100,000. Only the newest
    ``RECENT_STEPS`` × :data:`SPANS_PER_STEP` spans of a name are looked at (they end in step order)."""
    view = ProcessState(state.source, state.rank, state.attempt, state.instance)
    view.host, view.parents = state.host, state.parents
    tail = RECENT_STEPS * SPANS_PER_STEP
    for name, series in state.phases.items():
        steps = np.frombuffer(series.steps, dtype=np.int64)[-tail:]
        keep = steps >= first_step
        if keep.any():
            durs = np.frombuffer(series.durs, dtype=np.float64)[-tail:]
            ends = np.frombuffer(series.ends, dtype=np.float64)[-tail:]
            view.phases[name] = PhaseSeries(array("q", steps[keep].tobytes()), array("d", durs[keep].tobytes()),
                                            array("d", ends[keep].tobytes()))
    return view
