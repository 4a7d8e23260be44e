"""Analysis throughput: summarize (in process and as the CLI), export, DuckDB and a json.loads loop.

Generates a synthetic run once (cached under the temp dir): N ranks × M steps × 5 spans (``step``
with data_fetch, forward, backward, optimizer) plus a loss scalar per step, in the same fields the
SDK writes. Default 16 × 4000 ≈ 300 MB; ``--big`` ≈ 1 GB; ``--ranks/--steps`` for a smoke run.
Prints a markdown table; peak RSS is the summarize CLI process tree (parent + pool workers), sampled.

    .venv/bin/python benchmarks/analysis_throughput.py [--big] [--ranks N --steps M]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
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


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cli_summarize(run: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB, whole process tree, sampled every 20 ms) of the CLI."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(CLI), "summarize", str(run), "--json"], stdout=subprocess.DEVNULL)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [ps, *ps.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"otel-train summarize failed with exit code {proc.returncode}")
    single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return wall, max(peak / 2**20, single)


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


def export_chrome(run: Path, out: Path) -> object:
    from otel_train.analysis.chrome import export_trace

    return export_trace(run, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="≈1 GB: 16 ranks × 13500 steps")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--skip", default="", help="comma list of: export,json")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-bench")
    args = parser.parse_args()
    steps = args.steps or (13_500 if args.big else 4000)
    skip = set(filter(None, args.skip.split(",")))

    t_gen, run = timed(lambda: generate(args.cache, args.ranks, steps))
    assert isinstance(run, Path)
    size = sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir())
    mb = size / 2**20
    print(f"run: {args.ranks} ranks × {steps} steps, {mb:.0f} MB ({t_gen:.1f} s to generate/reuse), "
          f"{os.cpu_count()} CPUs", file=sys.stderr)

    rows: list[tuple[str, float, str]] = []
    t_duck, _ = timed(lambda: duckdb_query(run))
    rows.append(("DuckDB read_json group-by quantiles", t_duck, ""))
    t_sum, summary = timed(lambda: summarize(run, warn=print))
    assert isinstance(summary, dict) and summary["malformed_lines"] == 0
    rows.append(("summarize (in-process)", t_sum, f"{len(summary['phases'])} phases"))
    t_cli, rss = cli_summarize(run)
    rows.append(("`otel-train summarize --json` (subprocess)", t_cli, f"peak RSS {rss:.0f} MB"))
    if "export" not in skip:
        out = args.cache / "bench_trace.json"
        t_exp, res = timed(lambda: export_chrome(run, out))
        slices = getattr(res, "slices", 0)
        rows.append(("export chrome JSON (in-process)", t_exp, f"{slices / t_exp:,.0f} slices/s"))
        out.unlink(missing_ok=True)
    if "json" not in skip:
        t_json, n = timed(lambda: json_loop(run))
        rows.append(("plain `json.loads` loop", t_json, f"{n:,} lines"))

    print(f"| what ({mb:.0f} MB, {args.ranks} ranks × {steps} steps) | seconds | MB/s | × DuckDB | note |")
    print("|---|---:|---:|---:|---|")
    for what, secs, note in rows:
        print(f"| {what} | {secs:.2f} | {mb / secs:.0f} | {secs / t_duck:.2f} | {note} |")


if __name__ == "__main__":
    main()
