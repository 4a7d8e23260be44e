"""Measured step times of a real run, read straight from its trace files (the tests' and the
benchmarks' own reading, independent of the analysis under test)."""

from __future__ import annotations

import json
from pathlib import Path


def step_ms(path: Path) -> dict[int, float]:
    """Step -> its measured time (ms): the latest step-span end over ranks minus the step before's."""
    ends: dict[int, float] = {}
    for f in (path / "structured_logs").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "span_end" and r.get("name") == "step" and r.get("step") is not None:
                ends[r["step"]] = max(ends.get(r["step"], 0.0), r["ts"])
    steps = sorted(ends)
    return {s: (ends[s] - ends[p]) * 1000.0 for p, s in zip(steps, steps[1:]) if s == p + 1}
