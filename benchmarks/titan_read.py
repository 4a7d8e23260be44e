"""Reading torchtitan's structured-logger files beside ours: the cost per record (issue 44's target).

Generates two runs of the same shape as benchmarks/analysis_throughput.py's default (16 ranks × 4000
steps: ``step`` with data_fetch, forward, backward, optimizer, and a loss scalar per step, so 11
records a step): ours (that benchmark's generator, ≈ 320 MB) and the same timeline in torchtitan
0.3.0's record layout (every field its ``TraceJsonlFormatter`` writes). Then, on each, side by side
in this one process (each read uncached, after one warm-up read):

* decode: every record of every file through the reader (``Reader.batches``), no model;
* summarize: ``summarize(run, cache=False)`` with its default workers (the CLI's read).

Prints a markdown table of seconds, CPU seconds, and µs per record.

    .venv/bin/python benchmarks/titan_read.py [--ranks N --steps M] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from analysis_throughput import PHASES, generate, timed  # noqa: E402

from otel_train.analysis.records import Reader, find_process_files  # noqa: E402
from otel_train.analysis.summary import summarize  # noqa: E402

_CALLER = "torchtitan/train.py:612:train_step"


class _TitanRank:
    """One rank's file in their layout, on the timeline analysis_throughput draws."""

    def __init__(self, logs: Path, rank: int) -> None:
        self.rng = random.Random(rank)
        self.rank, self.pid, self.seq = rank, 40000 + rank, 0
        self.t_us = 1_700_000_000_000_000
        name = f"training.global_rank_{rank}.20240101-000000-TTN{rank:03d}.jsonl"
        self.f = (logs / name).open("w", buffering=1 << 20)
        self.head = (f'"tid": {self.pid}, "rank": {rank}, "global_rank": {rank}, "local_rank": {rank % 8}, '
                     f'"source": "training", "host_name": "node{rank // 8:03d}", "pid": {self.pid}')
        self.start = 0
        self.open_bwd = 0

    def rec(self, log_type: str, name: str, step: int, value: float | None = None, event: str | None = None,
            message: str = "") -> None:
        t = self.t_us
        val = f', "value": {value}' if value is not None else ""
        self.f.write(
            f'{{"delta_ms": 0.0123, {self.head}, "step": {step}, "relative_step": {step}, "time": {t // 1_000_000}, '
            f'"time_ms": {t // 1000}, "time_us": {t}, "log_type": "{log_type}", "log_type_name": "{name}", '
            f'"event_name": {json.dumps(event)}{val}, "caller": "{_CALLER}", "log_file": "train.py", '
            f'"log_function": "train_step", "log_level": "INFO", "logger_name": "torchtitan.structured_logger", '
            f'"seq_id": {self.seq}, "message": "{message}"}}\n')
        self.seq += 1

    def until_backward(self, step: int) -> int:
        self.start = self.t_us
        self.rec("event", "step_start", step)
        for name, ms in PHASES:
            self.t_us += 200
            self.rec("event", f"{name}_start", step)
            dur = int(ms * (0.8 + 0.4 * self.rng.random()) * 1000)
            if name == "backward":
                self.open_bwd = self.t_us
                return self.t_us + dur
            self.t_us += dur
            self.rec("event", f"{name}_end", step, value=dur / 1000)
        raise AssertionError("PHASES has no backward")

    def rest_of_step(self, step: int, last_ready: int) -> None:
        self.t_us = last_ready
        self.rec("event", "backward_end", step, value=(last_ready - self.open_bwd) / 1000)
        for name, ms in PHASES[[n for n, _ in PHASES].index("backward") + 1:]:
            self.t_us += 200
            self.rec("event", f"{name}_start", step)
            dur = int(ms * (0.8 + 0.4 * self.rng.random()) * 1000)
            self.t_us += dur
            self.rec("event", f"{name}_end", step, value=dur / 1000)
        self.t_us += 300
        self.rec("instant", "metric_value", step, value=round(self.rng.random(), 6), event="loss")
        self.rec("event", "step_end", step, value=(self.t_us - self.start) / 1000)


def generate_titan(root: Path, ranks: int, steps: int) -> Path:
    run = root / f"titan-{ranks}x{steps}"
    if (run / ".complete").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    logs = run / "structured_logs"
    logs.mkdir(parents=True)
    writers = [_TitanRank(logs, r) for r in range(ranks)]
    for step in range(steps):
        ready = [w.until_backward(step) for w in writers]
        for w in writers:
            w.rest_of_step(step, max(ready))
    for w in writers:
        w.f.close()
    (run / ".complete").write_text("ok")
    return run


def _decode(run: Path) -> int:
    reader = Reader(warn=lambda _: None)
    n = 0
    for pf in find_process_files(run):
        for batch in reader.batches(pf):
            n += len(batch)
    assert reader.malformed_lines == 0
    return n


def _size(run: Path) -> int:
    return sum(p.stat().st_size for p in (run / "structured_logs").iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-bench")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    runs = {"otel-train": generate(args.cache, args.ranks, args.steps),
            "torchtitan": generate_titan(args.cache, args.ranks, args.steps)}
    records = {k: _decode(r) for k, r in runs.items()}  # also the warm-up
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.repeat):
        for kind, run in runs.items():  # side by side: each round reads both
            wall, cpu, _ = timed(lambda r=run: _decode(r))
            rows.setdefault(("decode", kind), []).append((wall, cpu))
            wall, cpu, _ = timed(lambda r=run: summarize(r, cache=False, warn=lambda _: None))
            rows.setdefault(("summarize", kind), []).append((wall, cpu))
    print(f"{args.ranks} ranks × {args.steps} steps; median of {args.repeat} rounds\n")
    print("| read | format | MB | records | s | CPU s | µs/record (CPU) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (what, kind), values in rows.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        print(f"| {what} | {kind} | {_size(runs[kind]) / 1e6:.0f} | {records[kind]:,} | {wall:.2f} | {cpu:.2f} "
              f"| {cpu / records[kind] * 1e6:.2f} |")


if __name__ == "__main__":
    main()
