"""Analysis throughput: summarize and export (in process and as the CLI), DuckDB and a json.loads loop.

Generates a synthetic run once (cached under the temp dir): N ranks × M steps × 5 spans (``step``
with data_fetch, forward, backward, optimizer) plus a loss scalar per step, in the same fields the
SDK writes. Default 16 × 4000 ≈ 300 MB; ``--big`` ≈ 1 GB; ``--ranks/--steps`` for a smoke run.
Prints a markdown table; peak RSS is each CLI's process tree (parent + pool workers), sampled.
The export rows time Chrome JSON and Perfetto protobuf beside the DuckDB query of the same run.

    .venv/bin/python benchmarks/analysis_throughput.py [--big] [--ranks N --steps M] [--repeat N]
    .venv/bin/python benchmarks/analysis_throughput.py --targets [--big] [--repeat N] [--scale-kib K]

``--targets`` measures issue 20's targets instead, process to process (docs/benchmarks.md, "Reading a
run"): the DuckDB query in its own Python process beside ``summarize --json``, ``stats --json``,
``whatif --json`` and both exports, each read first (cache cleared) and then again (the read cache),
a ``--steps`` window of 10 steps, and the CLI's import time; the whole round quiet and again beside a
busy loop pinned to one core. With ``--scale-kib K`` it also times the window on the 1,024-rank scale
simulation at K and 8 K KiB per rank.

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
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import psutil

from otel_train import schema
from otel_train.analysis.summary import summarize

PHASES = (("data_fetch", 4.0), ("forward", 30.0), ("backward", 55.0), ("optimizer", 8.0))
CLI = Path(sys.executable).with_name("otel-train")


def generate(root: Path, ranks: int, steps: int) -> Path:
    """Write (or reuse) the synthetic run; returns the run directory. The ranks are data parallel:
    every rank leaves ``backward`` (its gradient all-reduce) when the last one has done its own
    backward work, so ``whatif`` replays the run (a run whose ranks drift apart is left out of it:
    docs/analysis.md, "When the model does not apply")."""
    run = root / f"run-{ranks}x{steps}-sync"
    done = run / ".complete"
    if done.exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    logs = run / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    writers = [_RankWriter(logs, rank, ranks) for rank in range(ranks)]
    try:
        for w in writers:
            w.line(schema.INSTANT, schema.INSTANT_PROCESS_START, "0" * 16, None, 0, ',"attrs":{}')
        for step in range(steps):
            ready = [w.until_backward(step) for w in writers]
            for w in writers:
                w.rest_of_step(step, max(ready))
        for w in writers:
            w.line(schema.INSTANT, schema.INSTANT_PROCESS_END, "0" * 16, None, steps - 1, ',"attrs":{}')
    finally:
        for w in writers:
            w.f.close()
    done.write_text("ok")
    return run


class _RankWriter:
    """One rank's file of the synthetic run, written a step at a time (its own random draws, its own
    clock; only the end of ``backward`` waits for the other ranks)."""

    def __init__(self, logs: Path, rank: int, world: int) -> None:
        self.rng = random.Random(rank)
        pid = 40000 + rank
        self.base = (
            f'"rank":{rank},"local_rank":{rank % 8},"world_size":{world},"host":"node{rank // 8:03d}",'
            f'"pid":{pid},"attempt":0,"run_id":"20240101-000000-bench","source":"training","tid":{pid}'
        )
        self.trace_id = f"{self.rng.getrandbits(128):032x}"
        self.ts = 1_700_000_000.0
        self.seq = 0
        self.step_id, self.step_start = "", 0.0
        self.open: tuple[str, float, float] = ("", 0.0, 0.0)  # backward: span id, start, own work (s)
        path = logs / schema.trace_file_name("training", rank, "20240101-000000", f"bnch{rank:02d}")
        self.f = path.open("w", buffering=1 << 20)

    def line(self, kind: str, name: str, sid: str, parent: str | None, step: int, extra: str) -> None:
        self.seq += 1
        event = name if kind in (schema.INSTANT, schema.SCALAR) else name + ("_start" if kind == schema.SPAN_START else "_end")
        par = f',"parent_span_id":"{parent}"' if parent else ""
        self.f.write(
            f'{{"v":1,"ts":{self.ts:.6f},"kind":"{kind}","event":"{event}","name":"{name}","trace_id":"{self.trace_id}",'
            f'"span_id":"{sid}"{par},"step":{step},"relative_step":{step},"epoch":{step // 1000},'
            f'"iteration":{step},{self.base},"seq":{self.seq},"caller":"train.py:88:train_loop"{extra}}}\n'
        )

    def _phase(self, name: str, ms: float, step: int) -> tuple[str, float]:
        sid = f"{self.rng.getrandbits(64):016x}"
        self.ts += 0.0002
        self.line(schema.SPAN_START, name, sid, self.step_id, step, ',"attrs":{"component":"trainer"}')
        return sid, ms * (0.8 + 0.4 * self.rng.random()) / 1000.0

    def _end(self, name: str, sid: str, dur: float, step: int) -> None:
        self.ts += dur
        self.line(schema.SPAN_END, name, sid, self.step_id, step, f',"dur_ms":{dur * 1000:.3f},"status":"ok","attrs":{{}}')

    def until_backward(self, step: int) -> float:
        """Write the step up to backward's start; return when this rank's own backward work is done."""
        self.step_id = f"{self.rng.getrandbits(64):016x}"
        self.step_start = self.ts
        self.line(schema.SPAN_START, "step", self.step_id, None, step, ',"attrs":{}')
        for name, ms in PHASES:
            sid, dur = self._phase(name, ms, step)
            if name == "backward":
                self.open = (sid, self.ts, dur)
                return self.ts + dur
            self._end(name, sid, dur, step)
        raise AssertionError("PHASES has no backward")

    def rest_of_step(self, step: int, last_ready: float) -> None:
        """backward ends when the last rank's work is done; then the phases after it and the step's end."""
        sid, start, _ = self.open
        self._end("backward", sid, last_ready - start, step)
        for name, ms in PHASES[[n for n, _ in PHASES].index("backward") + 1:]:
            span, dur = self._phase(name, ms, step)
            self._end(name, span, dur, step)
        self.ts += 0.0003
        self.line(schema.SCALAR, "scalar", self.step_id, None, step, f',"values":{{"loss":{self.rng.random():.6f},"lr":0.0003}}')
        self.line(schema.SPAN_END, "step", self.step_id, None, step,
                  f',"dur_ms":{(self.ts - self.step_start) * 1000:.3f},"status":"ok","attrs":{{}}')


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its reaped children (pool workers) so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """Wall and CPU seconds of ``fn()``, and its result."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - t0, cpu_seconds() - c0, out


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (with its pool workers) and peak RSS (MB) of an otel-train command: the
    process tree's sum, sampled every 20 ms, or the largest single process (the kernel's exact figure
    for the child), whichever is more."""
    return process([str(CLI), *args], env=env)


def process(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """:func:`cli`'s figures for any command line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
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
        raise SystemExit(f"{' '.join(argv[:2])} failed with exit code {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, max(peak / 2**20, usage.ru_maxrss / 1024)


def duckdb_sql(run: Path) -> str:
    """The expert's query: the four columns it needs, named; per-phase count, p50, p95 and max."""
    glob = str(run / schema.STRUCTURED_LOGS_DIR / "*.jsonl*")
    return f"""
        SELECT name, count(*), quantile_cont(dur_ms, 0.5), quantile_cont(dur_ms, 0.95), max(dur_ms)
        FROM read_json('{glob}', format='newline_delimited', ignore_errors=true,
                       columns={{kind: 'VARCHAR', name: 'VARCHAR', rank: 'INTEGER', dur_ms: 'DOUBLE'}})
        WHERE kind = 'span_end' GROUP BY name ORDER BY name
        """


def duckdb_query(run: Path) -> object:
    import duckdb

    return duckdb.connect().execute(duckdb_sql(run)).fetchall()


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
    t_sum, c_sum, summary = timed(lambda: summarize(run, warn=print, cache=False))
    assert isinstance(summary, dict) and summary["malformed_lines"] == 0
    rows.append(("summarize (in-process)", t_sum, c_sum, f"{len(summary['phases'])} phases"))
    t_cli, c_cli, rss = cli("summarize", str(run), "--json", "--no-cache")
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


# --- --targets: issue 20's targets, process to process (docs/benchmarks.md, "Reading a run") ------------



def drop_cache(run: Path) -> None:
    """Remove the run's read cache and remembered results (in this user's cache directory, as the CLI
    children find it: they inherit XDG_CACHE_HOME): its next read is cold."""
    from otel_train.analysis.reading.cache import cache_dir_of

    folder = cache_dir_of(run / schema.STRUCTURED_LOGS_DIR)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


DUCK_PROCESS = "import sys, duckdb; duckdb.connect().execute(sys.argv[1]).fetchall()"
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( +)(\S+)")
Row = tuple[str, float, float, float]  # what, wall s, CPU s, peak RSS MB


def bench_env(cache: Path, *, bytecode: bool = True) -> dict[str, str]:
    """The environment the process rows run in. With ``bytecode`` each module's bytecode is kept (under
    ``cache/pycache``, the source tree untouched), as an installed package has it; without, every start
    compiles the sources that have no ``__pycache__`` beside them (``PYTHONDONTWRITEBYTECODE=1``: a source
    checkout run as this project's sandbox runs it; installed dependencies keep their bytecode)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    if bytecode:
        env["PYTHONPYCACHEPREFIX"] = str(cache / "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def import_ms(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(every import, ``otel_train.cli``'s) cumulative milliseconds in one ``python -X importtime`` run,
    and the CPU milliseconds of the whole process (less sensitive to other work than wall time)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", *argv], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
        _, _, usage = os.wait4(proc.pid, 0)
        proc.returncode = 0
        err.seek(0)
        lines = err.read().splitlines()
    total = own = 0
    for m in filter(None, map(IMPORT_LINE.match, lines)):
        total += int(m[1]) if len(m[2]) == 1 else 0  # top level: its figure includes what it imported
        own = int(m[1]) if m[3] == "otel_train.cli" else own
    return total / 1000, own / 1000, (usage.ru_utime + usage.ru_stime) * 1000


def import_rows(small: Path, cache: Path, n: int = 5) -> list[str]:
    """The start-up table: median (range) of ``n`` runs, with bytecode and compiling every source."""
    cases = (("`import otel_train.cli`", ["-c", "import otel_train.cli"]),
             ("`otel-train --help`", [str(CLI), "--help"]),
             ("`otel-train summarize --json`, 2 ranks × 20 steps, remembered answer",
              [str(CLI), "summarize", str(small), "--json"]),
             ("`otel-train summarize --json --no-cache`, 2 ranks × 20 steps (read and analysed)",
              [str(CLI), "summarize", str(small), "--json", "--no-cache"]))
    out = [f"| start-up (median of {n}, `-X importtime`) | all imports, ms | of which `otel_train.cli` | "
           "process CPU, ms | all imports, sources compiled | target |", "|---|---:|---:|---:|---:|---|"]
    warm, cold = bench_env(cache), bench_env(cache, bytecode=False)
    for what, argv in cases:
        import_ms(argv, warm)  # writes the bytecode
        runs = [import_ms(argv, warm) for _ in range(n)]
        raw = [import_ms(argv, cold)[0] for _ in range(n)]
        total = [r[0] for r in runs]
        target = "≤ 150 ms: **" + ("met" if statistics.median(total) <= 150 else "missed") + "**"
        out.append(f"| {what} | {_spread(total, '.0f')} | {_spread([r[1] for r in runs], '.0f')} | "
                   f"{_spread([r[2] for r in runs], '.0f')} | {_spread(raw, '.0f')} | {target} |")
    return out


def has_option(command: str, option: str) -> bool:
    """Whether ``otel-train command --help`` lists ``option`` (rows for options not there yet are left out)."""
    shown = subprocess.run([str(CLI), command, "--help"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"}).stdout
    return option in shown


def commands(run: Path, out: Path) -> list[tuple[str, list[str]]]:
    """The commands issue 20 sets ratios for: (label, arguments)."""
    return [("summarize --json", ["summarize", str(run), "--json"]),
            ("stats --json", ["stats", str(run), "--json"]),
            ("whatif --json", ["whatif", str(run), "--json"]),
            ("export -f chrome", ["export", str(run), "-f", "chrome", "-o", str(out / "bench.json")]),
            ("export -f perfetto", ["export", str(run), "-f", "perfetto", "-o", str(out / "bench.pftrace")])]


def window_args(run: Path, first: int, out: Path) -> list[tuple[str, list[str]]]:
    """10-step windows from ``first``: summarize where it has ``--steps``, export (which has had it)."""
    steps = f"{first}-{first + 9}"
    rows = [("summarize --json", ["summarize", str(run), "--json", "--steps", steps])] if has_option("summarize", "--steps") else []
    return rows + [("export -f perfetto", ["export", str(run), "-f", "perfetto", "-o", str(out / "window.pftrace"),
                                           "--steps", steps])]


def target_round(run: Path, small: Path, out: Path, env: dict[str, str], first: int, only: str = "") -> list[Row]:
    """One round: the DuckDB process, the start-up reference, each command read first (cache cleared)
    then again, and the 10-step windows (cache cleared); ``only``: the commands whose label starts so."""
    rows: list[Row] = [("DuckDB query, in its own Python process", *process([sys.executable, "-c", DUCK_PROCESS,
                                                                              duckdb_sql(run)], env))]
    # The start-up reference reads and analyses its tiny run, as a window does (cache removed: a remembered
    # answer would import no analysis and make every window look slower than it is).
    drop_cache(small)
    rows.append(("start-up: `summarize --json`, 2 ranks × 20 steps", *cli("summarize", str(small), "--json", env=env)))
    for label, args in (c for c in commands(run, out) if c[0].startswith(only)):
        drop_cache(run)
        rows.append((f"`{label}`", *cli(*args, env=env)))
        rows.append((f"`{label}`, second read", *cli(*args, env=env)))
    for label, args in window_args(run, first, out) if not only else []:
        drop_cache(run)
        rows.append((f"`{label} --steps` (10 steps)", *cli(*args, env=env)))
    for f in out.glob("*.pftrace"):
        f.unlink()
    (out / "bench.json").unlink(missing_ok=True)
    return rows


@contextmanager
def busy_loop() -> Iterator[None]:
    """A Python busy loop pinned to CPU 0 while the block runs."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def conditions(run: Path, small: Path, out: Path, env: dict[str, str], first: int,
               repeat: int, only: str = "") -> dict[str, tuple[list[list[Row]], str]]:
    """Rounds quiet and beside the busy loop, each with its 1-minute load average before and after."""
    process([sys.executable, "-c", DUCK_PROCESS, duckdb_sql(run)], env)  # the run in the page cache, duckdb's bytecode
    result = {}
    for name in ("quiet", "busy loop"):
        with busy_loop() if name == "busy loop" else nullcontext():
            load0 = os.getloadavg()[0]
            rounds = [target_round(run, small, out, env, first, only) for _ in range(repeat)]
            result[name] = (rounds, f"load {load0:.1f} → {os.getloadavg()[0]:.1f}")
        print(f"{name}: {result[name][1]}", file=sys.stderr)
    return result


def _target(what: str, ratio: float, speedup: float | None, rss: float, big: bool, extra: float) -> str:
    """Issue 20's target for the row and whether its worst median meets it (``extra``: a window's seconds
    beyond the start-up row's)."""
    if speedup is not None:
        return f"≥ 5× faster than first: **{'met' if speedup >= 5 else 'missed'}**"
    if "--steps" in what:
        return f"{extra:+.2f} s over start-up; ≤ 0.1 s: **{'met' if extra <= 0.1 else 'missed'}**"
    limit = 1.0 if what.startswith("`summarize --json`") else 1.5 if what.startswith(("`stats", "`whatif", "`export")) else None
    if limit is None:
        return ""
    text = f"≤ {limit:.1f}× DuckDB: **{'met' if ratio <= limit else 'missed'}**"
    if big:
        text += f"; RSS ≤ 300 MB: **{'met' if rss <= 300 else 'missed'}**"
    return text


def target_table(result: dict[str, tuple[list[list[Row]], str]], label: str, big: bool) -> list[str]:
    """Markdown rows: each row's median (range) seconds and ratio to the same round's DuckDB query (second
    reads: to the same round's first read), quiet and under load, peak RSS, and the target."""
    names = list(result)
    head = " | ".join(f"{n}: s | × DuckDB" for n in names)
    out = [f"| what ({label}) | {head} | peak RSS, MB | target |", "|---|" + "---:|---:|" * len(names) + "---:|---|"]
    base = result[names[0]][0][0]
    for i, (what, *_rest) in enumerate(base):
        cells, worst, speed, rss, extra = [], 0.0, None, 0.0, -1e9
        for n in names:
            rounds = result[n][0]
            secs = [r[i][1] for r in rounds]
            extra = max(extra, statistics.median(r[i][1] - r[1][1] for r in rounds))  # beyond the start-up row
            ref = [r[i - 1][1] if what.endswith("second read") else r[0][1] for r in rounds]
            ratios = [s / b for s, b in zip(secs, ref)]
            rss = max(rss, *(r[i][3] for r in rounds))
            if what.endswith("second read"):
                speeds = [b / s for s, b in zip(secs, ref)]
                speed = min(speed or 1e9, statistics.median(speeds))
                cells.append(f"{_spread(secs, '.2f')} | {_spread(speeds, '.1f')}× faster")
            else:
                worst = max(worst, statistics.median(ratios))
                cells.append(f"{_spread(secs, '.2f')} | {_spread(ratios, '.2f')}")
        out.append(f"| {what} | {' | '.join(cells)} | {rss:.0f} | {_target(what, worst, speed, rss, big, extra)} |")
    out.append("")
    out.append("Load (1-minute average, before → after): " + "; ".join(f"{n} {result[n][1]}" for n in names))
    return out


def scale_windows(cache: Path, kib: int, env: dict[str, str], out: Path) -> list[str]:
    """A 10-step window of ``summarize`` on the 1,024-rank scale simulation at ``kib`` and 8 × ``kib`` KiB
    per rank: target ≤ 2 s whatever the size."""
    import scale_sim

    lines = ["| 1,024 ranks, 10-step window | run size | seconds | peak RSS, MB | target |", "|---|---:|---:|---:|---|"]
    for k in (kib, 8 * kib):
        run = scale_sim.generate(cache, 1024, k, 517, 0.0)
        size = sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir()) / 2**20
        first = max(2, k * 1024 // (scale_sim.RECORD_BYTES * 11)) // 2
        for label, args in window_args(run, first, out)[:-1]:  # the export window is timed on the main run
            drop_cache(run)
            wall, _, rss = cli(*args, env=env)
            lines.append(f"| `{label} --steps {first}-{first + 9}` | {size:.0f} MB | {wall:.2f} | {rss:.0f} | "
                         f"≤ 2 s: **{'met' if wall <= 2 else 'missed'}** |")
    return lines


def targets(args: argparse.Namespace, run: Path, label: str, steps: int) -> None:
    """``--targets``: the import-time table, then the process-to-process table, then the scale windows."""
    out = args.cache / "out"
    out.mkdir(parents=True, exist_ok=True)
    small = generate(args.cache, 2, 20)
    drop_cache(small)  # the start-up reference reads it fresh, then cached
    env = bench_env(args.cache)
    cli("summarize", str(small), "--json", env=env)  # bytecode written before anything is timed
    print(f"start: {time.strftime('%H:%M')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    if not args.only:
        print("\n".join(import_rows(small, args.cache)) + "\n")
    result = conditions(run, small, out, env, steps // 2, args.repeat, args.only)
    print("\n".join(target_table(result, label, args.big)) + "\n")
    if args.scale_kib:
        print("\n".join(scale_windows(args.cache, args.scale_kib, env, out)))


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
    parser.add_argument("--targets", action="store_true", help="issue 20's targets, process to process")
    parser.add_argument("--only", default="", help="with --targets: only the commands whose label starts so "
                        "(e.g. 'stats'), without the start-up table and the windows")
    parser.add_argument("--scale-kib", type=int, default=0, help="with --targets: windows on the 1,024-rank "
                        "scale simulation at this and 8x this KiB per rank")
    args = parser.parse_args()
    steps = args.steps or (13_500 if args.big else 4000)
    skip = set(filter(None, args.skip.split(",")))

    t_gen, _, run = timed(lambda: generate(args.cache, args.ranks, steps))
    assert isinstance(run, Path)
    size = sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir())
    mb = size / 2**20
    print(f"run: {args.ranks} ranks × {steps} steps, {mb:.0f} MB ({t_gen:.1f} s to generate/reuse), "
          f"{os.cpu_count()} CPUs", file=sys.stderr)
    if args.targets:
        return targets(args, run, f"{mb:.0f} MB, {args.ranks} ranks × {steps} steps", steps)
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
