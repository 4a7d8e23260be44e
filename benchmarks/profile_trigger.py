"""Per-step cost of the profiling hook outside a window (docs/profiling.md, "Cost").

One process, one run: tracing on, the step loop ``ot.set_step(step)`` (what ``training_step`` does at
each step change) timed with the profiling hook absent (profiling off: what the code did before the
hook existed, since nothing is installed then) and present (a ``profile_ranks``/``profile_steps``
schedule whose window is far ahead, plus ``profile_on=straggler``: the hook's one comparison per step).
The variants alternate in blocks; the median of the repeats is reported, with the hook's cost per step
(present - absent) and the ratio. Usage: ``python benchmarks/profile_trigger.py [--steps N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import otel_train as ot
from otel_train import context as step_context
from otel_train.profiling.schedule import Schedule
from otel_train.profiling.window import Windows


def loop(start: int, n: int) -> float:
    set_step = ot.set_step
    t0 = time.perf_counter_ns()
    for step in range(start, start + n):
        set_step(step)
    return (time.perf_counter_ns() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ot.init(save_path=tmp, enabled=True, watchdog=False, collectives="off")
        hook = Windows(rank=0, attempt=0, run_dir=tmp, schedule=Schedule(f"{10**12}-{10**12 + 2}"), window_steps=3,
                       max_windows=3, activities=("cpu",), instant=lambda name, attrs: None)
        absent, present, start = [], [], 0
        try:
            for _ in range(args.repeats):
                absent.append(loop(start, args.steps))
                start += args.steps
                step_context.step_listeners.append(hook.on_step)
                present.append(loop(start, args.steps))
                start += args.steps
                step_context.step_listeners.remove(hook.on_step)
            direct = loop_direct(hook, args.steps)
        finally:
            ot.shutdown()
    a, p = statistics.median(absent), statistics.median(present)
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "absent_ns_per_step": round(a, 1),
                      "present_ns_per_step": round(p, 1), "hook_ns_per_step": round(p - a, 1),
                      "ratio": round(p / a, 3), "on_step_call_ns": round(direct, 1)}))


def loop_direct(hook: Windows, n: int) -> float:
    """The hook's own call, alone (a bound-method call and one comparison)."""
    on_step = hook.on_step
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for step in range(n):
            on_step(step)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


if __name__ == "__main__":
    main()
