"""Analysis throughput: summarize and export (in process and as the CLI), DuckDB and a json.loads loop.

Generates a synthetic run once (cached under the temp dir): N ranks × M steps × 5 spans (``step``
with data_fetch, forward, backward, optimizer) plus a loss scalar per step, in the same fields the
SDK writes. Default 16 × 4000 ≈ 300 MB; ``--big`` ≈ 1 GB; ``--ranks/--steps`` for a smoke run.
Prints a markdown table; peak RSS is each CLI's process tree (parent + pool workers), sampled.
The export rows time Chrome JSON and Perfetto protobuf beside the DuckDB query of the same run.

    .venv/bin/python benchmarks/analysis_throughput.py [--big] [--ranks N --steps M] [--repeat N]

DuckDB is imported before anything is timed; with ``--repeat`` each round runs every row in the same
order and each row shows the median (range) of its seconds and of its ratio to the same round's
DuckDB query. CPU seconds (all threads, pool workers included) are less sensitive than wall time to
other work on a shared machine; their ratio to DuckDB's compares the work done.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from otel_train import schema
from otel_train.analysis.summary import summarize

PHASES = (("data_fetch", 4.0), ("forward", 30.0), ("backward", 55.0), ("optimizer", 8.0))
CLI = Path(sys.executable).with_name("otel-train")


def generate(root: Path, ranks: int, steps: int) -> Path:
    """Write (or reuse) the synthetic run; returns the run directory."""
    run = root / f"run-{ranks}x{steps}"
    done = run / ".complete"
    if done.exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    logs = run / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    for rank in range(ranks):
        _write_rank(logs, rank, ranks, steps)
    done.write_text("ok")
    return run


def _write_rank(logs: Path, rank: int, world: int, steps: int) -> None:
    rng = random.Random(rank)
    pid = 40000 + rank
    base = (
        f'"rank":{rank},"local_rank":{rank % 8},"world_size":{world},"host":"node{rank // 8:03d}",'
        f'"pid":{pid},"attempt":0,"run_id":"20240101-000000-bench","source":"training","tid":{pid}'
    )
    trace_id = f"{rng.getrandbits(128):032x}"
    ts = 1_700_000_000.0
    seq = 0
    path = logs / schema.trace_file_name("training", rank, "20240101-000000", f"bnch{rank:02d}")
    with path.open("w", buffering=1 << 20) as f:

        def line(kind: str, name: str, sid: str, parent: str | None, step: int, extra: str) -> None:
            nonlocal seq
            seq += 1
            event = name if kind in (schema.INSTANT, schema.SCALAR) else name + ("_start" if kind == schema.SPAN_START else "_end")
            par = f',"parent_span_id":"{parent}"' if parent else ""
            f.write(
                f'{{"v":1,"ts":{ts:.6f},"kind":"{kind}","event":"{event}","name":"{name}","trace_id":"{trace_id}",'
                f'"span_id":"{sid}"{par},"step":{step},"relative_step":{step},"epoch":{step // 1000},'
                f'"iteration":{step},{base},"seq":{seq},"caller":"train.py:88:train_loop"{extra}}}\n'
            )

        line(schema.INSTANT, schema.INSTANT_PROCESS_START, "0" * 16, None, 0, ',"attrs":{}')
        for step in range(steps):
            step_id = f"{rng.getrandbits(64):016x}"
            step_start = ts
            line(schema.SPAN_START, "step", step_id, None, step, ',"attrs":{}')
            for name, ms in PHASES:
                sid = f"{rng.getrandbits(64):016x}"
                ts += 0.0002
                line(schema.SPAN_START, name, sid, step_id, step, ',"attrs":{"component":"trainer"}')
                dur = ms * (0.8 + 0.4 * rng.random()) / 1000.0
                ts += dur
                line(schema.SPAN_END, name, sid, step_id, step, f',"dur_ms":{dur * 1000:.3f},"status":"ok","attrs":{{}}')
            ts += 0.0003
            line(schema.SCALAR, "scalar", step_id, None, step, f',"values":{{"loss":{rng.random():.6f},"lr":0.0003}}')
            line(schema.SPAN_END, "step", step_id, None, step, f',"dur_ms":{(ts - step_start) * 1000:.3f},"status":"ok","attrs":{{}}')
        line(schema.INSTANT, schema.INSTANT_PROCESS_END, "0" * 16, None, steps - 1, ',"attrs":{}')


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its reaped children (pool workers) so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """Wall and CPU seconds of ``fn()``, and its result."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - t0, cpu_seconds() - c0, out


def cli(*args: str) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (with its pool workers) and peak RSS (MB) of an otel-train command: the
    process tree's sum, sampled every 20 ms, or the largest single process (the kernel's exact figure
    for the child), whichever is more."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(CLI), *args], stdout=subprocess.DEVNULL)
    ps = psutil.Process(proc.pid)
    peak = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            tree = [ps, *ps.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"otel-train {args[0]} failed with exit code {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, max(peak / 2**20, usage.ru_maxrss / 1024)


def duckdb_query(run: Path) -> object:
    import duckdb

    glob = str(run / schema.STRUCTURED_LOGS_DIR / "*.jsonl*")
    con = duckdb.connect()
    return con.execute(
        f"""
        SELECT name, count(*), quantile_cont(dur_ms, 0.5), quantile_cont(dur_ms, 0.95), max(dur_ms)
        FROM read_json('{glob}', format='newline_delimited', ignore_errors=true,
                       columns={{kind: 'VARCHAR', name: 'VARCHAR', rank: 'INTEGER', dur_ms: 'DOUBLE'}})
        WHERE kind = 'span_end' GROUP BY name ORDER BY name
        """
    ).fetchall()


def json_loop(run: Path) -> int:
    n = 0
    for path in sorted((run / schema.STRUCTURED_LOGS_DIR).iterdir()):
        with path.open("rb") as f:
            for line in f:
                json.loads(line)
                n += 1
    return n


def export(run: Path, fmt: str, out: Path) -> object:
    from otel_train.analysis.export import export as export_run

    return export_run(run, fmt, out)


def measure(run: Path, cache: Path, skip: set[str]) -> list[tuple[str, float, float, str]]:
    """One round: (what, seconds, CPU seconds, note) of every row, the DuckDB query first."""
    rows: list[tuple[str, float, float, str]] = []
    t_duck, c_duck, _ = timed(lambda: duckdb_query(run))
    rows.append(("DuckDB read_json group-by quantiles", t_duck, c_duck, ""))
    t_sum, c_sum, summary = timed(lambda: summarize(run, warn=print))
    assert isinstance(summary, dict) and summary["malformed_lines"] == 0
    rows.append(("summarize (in-process)", t_sum, c_sum, f"{len(summary['phases'])} phases"))
    t_cli, c_cli, rss = cli("summarize", str(run), "--json")
    rows.append(("`otel-train summarize --json` (subprocess)", t_cli, c_cli, f"peak RSS {rss:.0f} MB"))
    if "export" not in skip:
        for fmt, label, suffix in (("chrome", "Chrome JSON", "json"), ("perfetto", "Perfetto protobuf", "pftrace")):
            out = cache / f"bench_trace.{suffix}"
            t_exp, c_exp, res = timed(lambda: export(run, fmt, out))
            slices = getattr(res, "slices", 0)
            rows.append((f"export {label} (in-process)", t_exp, c_exp,
                         f"{slices / t_exp:,.0f} slices/s, {out.stat().st_size / 2**20:.0f} MB"))
            t_cli, c_cli, rss = cli("export", str(run), "-f", fmt, "-o", str(out))
            rows.append((f"`otel-train export -f {fmt}` (subprocess)", t_cli, c_cli, f"peak RSS {rss:.0f} MB"))
            out.unlink(missing_ok=True)
    if "json" not in skip:
        t_json, c_json, n = timed(lambda: json_loop(run))
        rows.append(("plain `json.loads` loop", t_json, c_json, f"{n:,} lines"))
    return rows


def _spread(values: list[float], fmt: str) -> str:
    """The median, and the range when there is more than one value."""
    mid = statistics.median(values)
    if len(values) == 1:
        return format(mid, fmt)
    return f"{format(mid, fmt)} ({format(min(values), fmt)} – {format(max(values), fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="≈1 GB: 16 ranks × 13500 steps")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--skip", default="", help="comma list of: export,json")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; each row shows the median (and range)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-bench")
    args = parser.parse_args()
    steps = args.steps or (13_500 if args.big else 4000)
    skip = set(filter(None, args.skip.split(",")))

    t_gen, _, run = timed(lambda: generate(args.cache, args.ranks, steps))
    assert isinstance(run, Path)
    size = sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir())
    mb = size / 2**20
    print(f"run: {args.ranks} ranks × {steps} steps, {mb:.0f} MB ({t_gen:.1f} s to generate/reuse), "
          f"{os.cpu_count()} CPUs", file=sys.stderr)
    import duckdb  # noqa: F401 - imported before anything is timed: the import is not the query

    rounds = [measure(run, args.cache, skip) for _ in range(args.repeat)]
    print(f"| what ({mb:.0f} MB, {args.ranks} ranks × {steps} steps) | seconds | CPU s | MB/s | × DuckDB | "
          "× DuckDB (CPU) | note |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for i, (what, _, _, note) in enumerate(rounds[-1]):
        secs = [r[i][1] for r in rounds]
        cpu = [r[i][2] for r in rounds]
        ratios = [r[i][1] / r[0][1] for r in rounds]  # against the same round's DuckDB query
        cpu_ratios = [r[i][2] / r[0][2] for r in rounds]
        print(f"| {what} | {_spread(secs, '.2f')} | {_spread(cpu, '.2f')} | {mb / statistics.median(secs):.0f} | "
              f"{_spread(ratios, '.2f')} | {_spread(cpu_ratios, '.2f')} | {note} |")


if __name__ == "__main__":
    main()
