"""The run's torch.profiler windows, listed from ``<run>/profiles/`` (docs/profiling.md).

A window's file name says all ``summarize`` shows of it:
``profiles/rank_<r>/<reason>.steps_<first>-<last>[.attempt_<a>].pt.trace.json``. Each is listed beside
the findings, with the phase of the rank's ``straggler`` finding when there is one ("rank 2 profiled
at steps 22–24: straggler in forward").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from otel_train import schema
from otel_train.analysis.reading.cache import uses
from otel_train.analysis.records import logs_dir

PROFILES_DIR = schema.PROFILES_DIR
_NAME = re.compile(r"(scheduled|straggler|slow_step)\.steps_(\d+)-(\d+)(?:\.attempt_(\d+))?\.pt\.trace\.json(?:\.gz)?")
_RANK = re.compile(r"rank_(\d+)")


def profiles_dir(path: str | Path) -> Path:
    logs = logs_dir(path)
    return (logs.parent if logs.name == schema.STRUCTURED_LOGS_DIR else logs) / PROFILES_DIR


def windows(path: str | Path) -> list[dict[str, Any]]:
    """``[{"rank", "attempt", "steps": [first, last], "reason", "path"}]`` by rank and first step; none
    when the run has no ``profiles/``. Files of other names are not windows and are left out."""
    root = profiles_dir(path)
    uses(root)  # a remembered summary depends on the windows, there or not
    if not root.is_dir():
        return []
    out = []
    for folder in root.iterdir():
        rank = _RANK.fullmatch(folder.name)
        if rank is None or not folder.is_dir():
            continue
        for file in folder.iterdir():
            match = _NAME.fullmatch(file.name)
            if match:
                out.append({"rank": int(rank[1]), "attempt": int(match[4] or 0),
                            "steps": [int(match[2]), int(match[3])], "reason": match[1],
                            "path": f"{PROFILES_DIR}/{folder.name}/{file.name}"})
    return sorted(out, key=lambda w: (w["rank"], w["attempt"], w["steps"]))


def with_profiles(summary: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """``summary`` with its ``profiles`` rows: each window and the phase of its rank's straggler finding."""
    phases = {f["rank"]: f.get("phase") for f in summary.get("findings", []) if f.get("kind") == "straggler"}
    summary["profiles"] = [{**w, "phase": phases.get(w["rank"])} for w in windows(path)]
    return summary


def line(window: dict[str, Any]) -> str:
    """``rank 2 profiled at steps 22–24: straggler in forward`` (plain text: the caller prints it as data)."""
    first, last = window["steps"]
    attempt = f" (attempt {window['attempt']})" if window.get("attempt") else ""
    phase = f" in {window['phase']}" if window.get("phase") else ""
    return f"rank {window['rank']}{attempt} profiled at steps {first}\u2013{last}: {window['reason']}{phase}"
