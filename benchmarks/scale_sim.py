"""Scale simulation: a synthetic 1,024-rank run with one injected hang, ``summarize --fast`` against a full
summarize at two file sizes 8× apart (time and peak RSS, the CLI as users run it).

Every rank writes the records the SDK writes (``step`` with data_fetch, forward, backward, optimizer,
a loss scalar); at the last step one rank stops inside ``data_fetch`` and every other rank waits in
``backward``'s all-reduce, so both summaries must name that rank. Runs are cached under the temp dir.

    .venv/bin/python benchmarks/scale_sim.py [--ranks 1024] [--kib 64] [--factor 8] [--hang-rank 517]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from otel_train import schema

CLI = Path(sys.executable).with_name("otel-train")
PHASES = (("data_fetch", 4.0), ("forward", 30.0), ("backward", 55.0), ("optimizer", 8.0))
RECORD_BYTES = 470  # about what one generated line takes


def generate(root: Path, ranks: int, kib_per_rank: int, hang_rank: int) -> Path:
    """Write (or reuse) a run of ``ranks`` files of about ``kib_per_rank`` KiB each; returns the run dir."""
    run = root / f"scale-{ranks}x{kib_per_rank}k-hang{hang_rank}"
    if (run / ".complete").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    logs = run / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    steps = max(2, kib_per_rank * 1024 // (RECORD_BYTES * 11))
    for rank in range(ranks):
        _write_rank(logs, rank, ranks, steps, hang=rank == hang_rank)
    (run / ".complete").write_text("ok")
    return run


def _write_rank(logs: Path, rank: int, world: int, steps: int, *, hang: bool) -> None:
    rng = random.Random(rank)
    pid = 10_000 + rank
    base = (f'"rank":{rank},"local_rank":{rank % 8},"world_size":{world},"host":"node{rank // 8:04d}",'
            f'"pid":{pid},"attempt":0,"run_id":"scale-sim","source":"training","tid":{pid}')
    ts, seq = 1_700_000_000.0, 0
    lines: list[str] = []

    def line(kind: str, name: str, sid: str, parent: str | None, step: int, extra: str = "") -> None:
        nonlocal seq
        seq += 1
        event = name + {"span_start": "_start", "span_end": "_end"}.get(kind, "")
        par = f',"parent_span_id":"{parent}"' if parent else ""
        lines.append(f'{{"v":1,"ts":{ts:.6f},"kind":"{kind}","event":"{event}","name":"{name}",'
                     f'"trace_id":"{step:032x}","span_id":"{sid}"{par},"step":{step},"relative_step":{step},'
                     f'{base},"seq":{seq},"caller":"train.py:88:train_loop"{extra}}}')

    line("instant", "process_start", "0" * 16, None, 0, ',"attrs":{}')
    for step in range(steps + 1):
        step_id = f"{rng.getrandbits(64):016x}"
        step_start = ts
        line("span_start", "step", step_id, None, step)
        for name, ms in PHASES:
            sid = f"{rng.getrandbits(64):016x}"
            ts += 0.0002
            line("span_start", name, sid, step_id, step)
            if step == steps and (name == "data_fetch" if hang else name == "backward"):
                break  # the last step: the culprit never gets its batch, the others wait in all-reduce
            dur = ms * (0.8 + 0.4 * rng.random()) / 1000.0
            ts += dur
            line("span_end", name, sid, step_id, step, f',"dur_ms":{dur * 1000:.3f},"status":"ok"')
        else:
            ts += 0.0003
            line("scalar", "scalar", step_id, None, step, f',"values":{{"loss":{rng.random():.6f}}}')
            line("span_end", "step", step_id, None, step,
                 f',"dur_ms":{(ts - step_start) * 1000:.3f},"status":"ok"')
    path = logs / schema.trace_file_name("training", rank, "20240101-000000", f"s{rank:05d}")
    path.write_text("\n".join(lines) + "\n")


def run_cli(run: Path, *extra: str) -> tuple[float, float, dict]:
    """Wall seconds, peak RSS (MB, whole process tree) and the JSON of ``otel-train summarize``."""
    with tempfile.TemporaryFile() as out:  # a file, not a pipe: a big JSON answer never blocks the child
        t0 = time.perf_counter()
        proc = subprocess.Popen([str(CLI), "summarize", str(run), "--json", *extra], stdout=out)
        ps = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"otel-train summarize {' '.join(extra)} exited {proc.returncode}")
        out.seek(0)
        return wall, peak / 2**20, json.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--kib", type=int, default=64, help="KiB per rank of the smaller run")
    parser.add_argument("--factor", type=int, default=8, help="the bigger run's files are this many times bigger")
    parser.add_argument("--hang-rank", type=int, default=517)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-scale")
    args = parser.parse_args()
    hang_rank = min(args.hang_rank, args.ranks - 1)
    rows = []
    fast_times = []
    for kib in (args.kib, args.kib * args.factor):
        run = generate(args.cache, args.ranks, kib, hang_rank)
        size = sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir()) / 2**20
        full_s, full_rss, full = run_cli(run)
        fast_s, fast_rss, quick = run_cli(run, "--fast")
        culprits = {(f["kind"], f["rank"]) for f in full["findings"] if f["kind"] == "hang"}
        same = culprits == {(f["kind"], f["rank"]) for f in quick["findings"] if f["kind"] == "hang"}
        fast_times.append(fast_s)
        rows.append(f"| {args.ranks} × {kib} KiB ({size:.0f} MB) | {full_s:.2f} s, {full_rss:.0f} MB | "
                    f"{fast_s:.2f} s, {fast_rss:.0f} MB | {sorted(culprits)} | {'yes' if same else 'NO'} |")
    print("| run | full summarize (time, peak RSS) | `--fast` (time, peak RSS) | hang culprit | same culprit |")
    print("|---|---:|---:|---|---|")
    print("\n".join(rows))
    print(f"\n`--fast` time grows {fast_times[1] / fast_times[0]:.2f}× for {args.factor}× bigger files")


if __name__ == "__main__":
    main()
