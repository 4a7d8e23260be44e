"""The clock the what-if compares hosts on, and the answer's note of it (docs/analysis.md "What-if")."""

from __future__ import annotations

from typing import Any

import numpy as np

from otel_train.analysis.clock import Clock
from otel_train.analysis.comm import CommGraph, run_clock
from otel_train.analysis.spans import Run


def _clock(run: Run) -> Clock | None:
    """The run's clock estimate when it aligns hosts; None (the per-host median shift) for one host,
    hosts without a shared collective, and ``--no-align``. A run with more than ``CLOCK_SAMPLE_OPS``
    comm ops whose comm graph is not built yet is estimated from the ops of ``CLOCK_SAMPLE_STEPS``
    steps spread over the run (building the whole graph costs tens of µs an op)."""
    if len({d.host for d in run.processes}) < 2:
        return None
    if run.graphs is None and sum(len(d.comm) for d in run.processes) > CLOCK_SAMPLE_OPS:
        clock: Clock | None = _sampled_clock(run)
    else:
        clock = next((g.clock for g in run.comm.values() if g.clock is not None), None)
    return clock if clock is not None and clock.applied else None


CLOCK_SAMPLE_OPS = 200_000
CLOCK_SAMPLE_STEPS = 32


def _sampled_clock(run: Run) -> Clock:
    """The clock estimate (docs/clock.md) from the comm ops of up to ``CLOCK_SAMPLE_STEPS`` steps,
    evenly spread over the steps the ops carry."""
    steps = np.unique(np.concatenate([np.frombuffer(d.comm.step, np.int64) for d in run.processes]))
    steps = steps[steps >= 0]
    keep = steps[np.linspace(0, steps.size - 1, min(CLOCK_SAMPLE_STEPS, steps.size)).astype(int)] if steps.size else steps
    graphs: dict[tuple[str, int], CommGraph] = {}
    for d in run.processes:
        g = graphs.setdefault((d.source, d.attempt), CommGraph(source=d.source, attempt=d.attempt))
        for group in d.comm_groups.values():
            g.add_group(group)
        g.world = max(g.world, d.world_size or 0, d.rank + 1)
        g.hosts[d.rank] = d.host
        for i in np.flatnonzero(np.isin(np.frombuffer(d.comm.step, np.int64), keep)).tolist():
            g.add(d.comm.op(i, d.rank, d.attempt))
    return run_clock(run, graphs)


def clock_note(run: Run, clock: Clock | None) -> dict[str, Any] | None:
    """What the replay compared hosts on: None for one host; else ``{"reference", "aligned", "hosts"}``
    (the hosts' offset rows when aligned by the estimate ``clock``)."""
    if len({d.host for d in run.processes}) < 2:
        return None
    return {"reference": clock.reference if clock else None, "aligned": clock is not None,
            "hosts": clock.rows() if clock else []}
