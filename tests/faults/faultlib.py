"""Shared pieces of the fault suite: trial counts, the invariants a trace must keep, the results table.

Every fault test states what must hold (``HOLDS``) and checks it on real files written by real
processes. ``FAULT_TRIALS`` raises the number of randomized trials (``make faults``); with
``FAULT_REPORT=<file>`` each test appends one JSON line (fault, trials, what held, result) that
``tests/faults/report.py`` turns into docs/reliability.md's table.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_train import schema as S


def trials(default: int) -> int:
    """``default`` trials, or ``FAULT_TRIALS`` when that is larger (``make faults``)."""
    return max(default, int(os.environ.get("FAULT_TRIALS", "0") or 0))


def examples(default: int) -> int:
    """``default`` hypothesis examples, or ``FUZZ_EXAMPLES`` when that is larger."""
    return max(default, int(os.environ.get("FUZZ_EXAMPLES", "0") or 0))


EXPLORE = bool(os.environ.get("FUZZ_EXAMPLES"))
"""Random cases only when asked for more (``make faults``); ``make test`` runs the same cases every
time (hypothesis ``derandomize``), so a red run is reproducible and never a coin toss."""


@contextmanager
def reported(fault: str, holds: str, count: int, seconds: float | None = None) -> Iterator[None]:
    """Run a fault test's body; append its outcome to ``FAULT_REPORT`` (when set) either way: the
    fault, the number of trials, what must hold, pass or the failure's first line, and how long."""
    t0 = time.monotonic()
    failure = None
    try:
        yield
    except BaseException as exc:
        failure = " ".join(str(exc).split())[:240] or type(exc).__name__
        raise
    finally:
        target = os.environ.get("FAULT_REPORT")
        if target:
            took = time.monotonic() - t0 if seconds is None else seconds
            row = {"fault": fault, "trials": count, "holds": holds, "ok": failure is None, "failure": failure,
                   "seconds": round(took, 1)}
            with open(target, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------
# Reading a trace strictly: every byte accounted for.


def segments(save_path: Path) -> dict[str, list[Path]]:
    """Each process's files under ``structured_logs``, oldest segment first."""
    by_active: dict[str, list[tuple[int, Path]]] = {}
    for path in (Path(save_path) / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}*"):
        match = S.FILE_RE.match(path.name)
        if match is None or not path.is_file():
            continue
        segment = int(match["segment"] or 0)
        active = path.name if not segment else path.name.rsplit(".", 1)[0]
        by_active.setdefault(active, []).append((segment, path))
    return {name: [p for _, p in sorted(parts, key=lambda sp: -sp[0])] for name, parts in sorted(by_active.items())}


@dataclass
class Trace:
    """One process's records, in file order, with what could not be parsed."""

    records: list[dict[str, Any]] = field(default_factory=list)
    torn: list[bytes] = field(default_factory=list)  # lines that are not JSON objects
    torn_tail: bool = False  # the very last bytes of the newest segment lack a newline
    sizes: list[int] = field(default_factory=list)

    @property
    def seqs(self) -> list[int]:
        return [r[S.SEQ] for r in self.records]


def read_trace(paths: list[Path]) -> Trace:
    trace = Trace()
    for i, path in enumerate(paths):
        data = path.read_bytes()
        trace.sizes.append(len(data))
        lines = data.split(b"\n")
        tail = lines.pop()
        if tail:
            if i == len(paths) - 1:
                trace.torn_tail = True
            trace.torn.append(tail)
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                trace.torn.append(line)
                continue
            if not isinstance(record, dict):
                trace.torn.append(line)
                continue
            trace.records.append(record)
    return trace


def traces(save_path: Path) -> list[Trace]:
    return [read_trace(paths) for paths in segments(save_path).values()]


def assert_gapless(trace: Trace, *, start: int | None = 1) -> None:
    seqs = trace.seqs
    assert seqs, "no records"
    first = seqs[0] if start is None else start
    assert seqs == list(range(first, first + len(seqs))), _first_gap(seqs, first)


def _first_gap(seqs: list[int], first: int) -> str:
    for expected, got in zip(range(first, first + len(seqs)), seqs):
        if expected != got:
            return f"seq gap: expected {expected}, got {got} (of {len(seqs)} records)"
    return "seq mismatch"


def unpaired(trace: Trace) -> tuple[list[dict], list[dict]]:
    """(span starts without an end, span ends without a start) by span id."""
    starts = {r[S.SPAN_ID]: r for r in trace.records if r[S.KIND] == S.SPAN_START}
    ends = {r[S.SPAN_ID]: r for r in trace.records if r[S.KIND] == S.SPAN_END}
    return [r for k, r in starts.items() if k not in ends], [r for k, r in ends.items() if k not in starts]


def assert_clean_end(trace: Trace) -> None:
    """What a shutdown (clean, atexit or SIGTERM) must leave: whole records, seq 1..N, every span
    ended, process_end last and counting every record."""
    assert not trace.torn, f"torn lines: {[t[:80] for t in trace.torn]}"
    assert_gapless(trace)
    open_starts, orphan_ends = unpaired(trace)
    assert not open_starts, f"spans with a start and no end: {[(r[S.NAME], r[S.TID]) for r in open_starts][:5]}"
    assert not orphan_ends, f"span ends without a start: {[r[S.NAME] for r in orphan_ends][:5]}"
    last = trace.records[-1]
    assert last[S.NAME] == S.INSTANT_PROCESS_END, f"last record is {last[S.EVENT]}, not process_end"
    assert last[S.ATTRS]["records"] == last[S.SEQ] == len(trace.records)
    assert [r[S.NAME] for r in trace.records].count(S.INSTANT_PROCESS_END) == 1
