"""Synthetic data-parallel runs with exactly known timings: every rank waits for the last one in the
gradient all-reduce (what the what-if model assumes; docs/analysis.md "What-if")."""

from __future__ import annotations

from collections.abc import Callable

from analysis_fixtures import Proc

from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER, STEP

Times = Callable[[int, int], dict[str, float]]


def simulate(procs: list[Proc], steps: int | range, times: Times) -> None:
    """Data-parallel steps (``steps``: a count from 0, or the step numbers): data_fetch, forward, then
    backward ends for everyone ``tail`` ms after the last rank arrives, then optimizer.
    ``times(rank, step)`` gives each rank's ms per phase and tail."""
    for s in range(steps) if isinstance(steps, int) else steps:
        t = {p.rank: times(p.rank, s) for p in procs}
        for p in procs:
            p.set_step(s)
            p.start(STEP)
            for name in (DATA_FETCH, FORWARD):
                p.start(name)
                p.advance(t[p.rank][name])
                p.end()
            p.start(BACKWARD)
        last = max(p.now_ms for p in procs)
        for p in procs:
            p.now_ms = last + t[p.rank]["tail"]
            p.end()
            p.start(OPTIMIZER)
            p.advance(t[p.rank][OPTIMIZER])
            p.end()
            p.end()
    for p in procs:
        p.shutdown()


def base(rank: int, step: int) -> dict[str, float]:
    return {DATA_FETCH: 5.0, FORWARD: 20.0, "tail": 30.0, OPTIMIZER: 5.0}
