"""Long lines and files with no tail to stand on: reading cost per byte, peak RSS, ``--fast`` vs full.

``python benchmarks/long_lines.py [--total-mib 256] [--rounds 2] [--out DIR]`` (docs/reliability.md,
"Long lines and --fast"). Every figure is one command in a fresh process, measured from outside
(wall time, CPU time and peak RSS from ``wait4``), the best of ``--rounds``:

1. **Line length.** Files of ``--total-mib`` MiB made of lines of 1, 4, 16, 64 and 256 MiB (valid
   records whose ``attrs`` hold one long string; lines past ``MAX_LINE_BYTES`` are skipped as they are
   read), each read by ``otel-train summarize --json``: CPU seconds per GiB (start-up, measured on a
   1 KiB file, taken off) and peak RSS. CPU time, not wall time, is what is compared: it does not move
   with the load other jobs put on the machine. Target: flat time
   per byte, peak RSS <= 100 MB whatever the length.
2. **--fast against a full summarize** on three shapes: a step-less file (spans, no step ever set,
   about 215 MB), 10 M malformed lines, one 192 MiB line between valid records. Target: ``--fast`` <=
   1.0x a full summarize's time and peak RSS. Also both in one process, alternated (best of 5 or
   ``--rounds``): CPU seconds without start-up.

Prints a Markdown table per part; ``--json`` prints the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from otel_train import schema as S

MIB = 1 << 20
LENGTHS_MIB = (1, 4, 16, 64, 256)
HEAD = ('{"v":1,"ts":%d.5,"kind":"instant","event":"note","name":"note","seq":%d,"rank":0,"world_size":1,'
        '"pid":1,"tid":1,"host":"h","attempt":0,"run_id":"r","source":"training"')


def _logs(run: Path) -> Path:
    logs = run / S.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    return logs / S.trace_file_name("training", 0, "20260101-000000", "abcdef")


def _long_record(f, seq: int, length: int) -> None:
    head = (HEAD % (1_790_000_000 + seq, seq) + ',"attrs":{"pad":"').encode()
    tail = b'"}}\n'
    left = length - len(head) - len(tail)
    f.write(head)
    block = b"x" * MIB
    while left > 0:
        f.write(block[: min(left, MIB)])
        left -= MIB
    f.write(tail)


def write_long_lines(run: Path, total: int, length: int) -> None:
    with open(_logs(run), "wb") as f:
        for seq in range(1, max(1, total // length) + 1):
            _long_record(f, seq, length)


def write_stepless(run: Path, total: int) -> None:
    start = ('{"v":1,"ts":%d.%06d,"kind":"span_start","event":"load_start","name":"load","trace_id":"%032x",'
             '"span_id":"%016x","rank":0,"local_rank":0,"world_size":1,"host":"h","pid":1,"attempt":0,'
             '"run_id":"r","source":"training","tid":1,"seq":%d,"caller":"/srv/data/loader.py:88:fetch"}\n')
    end = ('{"v":1,"ts":%d.%06d,"kind":"span_end","event":"load_end","name":"load","trace_id":"%032x",'
           '"span_id":"%016x","rank":0,"local_rank":0,"world_size":1,"host":"h","pid":1,"attempt":0,'
           '"run_id":"r","source":"training","tid":1,"seq":%d,"dur_ms":1.250,"status":"ok"}\n')
    written, seq, t = 0, 0, 1_790_000_000_000_000
    with open(_logs(run), "w") as f:
        while written < total:
            lines = []
            for _ in range(1000):
                seq += 2
                sid = seq * 7919
                lines.append(start % (t // 10**6, t % 10**6, 1, sid, seq - 1))
                t += 1250
                lines.append(end % (t // 10**6, t % 10**6, 1, sid, seq))
                t += 10
            text = "".join(lines)
            f.write(text)
            written += len(text)


def write_malformed(run: Path, lines: int) -> None:
    with open(_logs(run), "wb") as f:
        f.write((HEAD % (1_790_000_000, 1) + "}\n").encode())
        block = b"not a record, just text\n" * 100_000
        for _ in range(lines // 100_000):
            f.write(block)


def write_huge_line(run: Path, length: int) -> None:
    with open(_logs(run), "wb") as f:
        f.write((HEAD % (1_790_000_000, 1) + "}\n").encode())
        _long_record(f, 2, length)
        f.write((HEAD % (1_790_000_003, 3) + "}\n").encode())


def measure(argv: list[str], rounds: int) -> dict[str, float]:
    """Best wall time, CPU time (user + system, its pool workers included) and peak RSS (MB) of
    ``argv`` over ``rounds`` fresh processes."""
    best_s, best_cpu, best_mb = float("inf"), float("inf"), float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        took = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}")
        best_s, best_mb = min(best_s, took), min(best_mb, usage.ru_maxrss / 1024)
        best_cpu = min(best_cpu, usage.ru_utime + usage.ru_stime)
    return {"s": best_s, "cpu_s": best_cpu, "rss_mb": best_mb}


def summarize(run: Path, fast: bool = False) -> list[str]:
    return [sys.executable, "-m", "otel_train.cli", "summarize", str(run), "--json", *(["--fast"] if fast else [])]


def part_lengths(tmp: Path, total_mib: int, rounds: int) -> list[dict]:
    tiny = tmp / "tiny"
    write_long_lines(tiny, 1024, 1024)
    start = measure(summarize(tiny), max(rounds, 3))  # start-up and a 1 KiB file: taken off every row
    rows = []
    for length in LENGTHS_MIB:
        run = tmp / f"lines-{length}"
        total = max(total_mib, length) * MIB
        write_long_lines(run, total, length * MIB)
        size = sum(p.stat().st_size for p in run.rglob("*.jsonl"))
        got = measure(summarize(run), rounds)
        gib = size / (1 << 30)
        inside = in_process(run, max(rounds, 3), kinds="full")["full"]
        rows.append({"line_mib": length, "file_mib": size / MIB, **got, "start_cpu_s": start["cpu_s"],
                     "start_rss_mb": start["rss_mb"], "cpu_s_per_gib": (got["cpu_s"] - start["cpu_s"]) / gib,
                     "in_process_s_per_gib": inside / gib})
        shutil.rmtree(run)
    return rows


def _interleaved(run: Path, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Full and --fast one after the other, ``rounds`` times: the best of each (load moves both alike)."""
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for fast in (False, True):
            runs[fast].append(measure(summarize(run, fast=fast), 1))
    return tuple({k: min(r[k] for r in runs[fast]) for k in runs[fast][0]} for fast in (False, True))  # type: ignore[return-value]


IN_PROCESS = """
import json, sys, time
from otel_train.analysis.fast import summarize_fast
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize_run
quiet = lambda message: None
best = {kind: float("inf") for kind in sys.argv[3].split(",")}
for _ in range(int(sys.argv[2])):
    for kind in best:
        t0 = time.process_time()
        summarize_fast(sys.argv[1], warn=quiet) if kind == "fast" else summarize_run(load_run(sys.argv[1], warn=quiet))
        best[kind] = min(best[kind], time.process_time() - t0)
print(json.dumps(best))
"""


def in_process(run: Path, rounds: int, kinds: str = "full,fast") -> dict[str, float]:
    """CPU seconds of a full summarize and of --fast in one process, alternated, best of ``rounds``
    each: no start-up in either, and load moves both alike."""
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, str(run), str(rounds), kinds], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def part_fast(tmp: Path, rounds: int) -> list[dict]:
    shapes = {
        "step-less spans (215 MB)": lambda run: write_stepless(run, 215_000_000),
        "10 M malformed lines": lambda run: write_malformed(run, 10_000_000),
        "one 192 MiB line": lambda run: write_huge_line(run, 192 * MIB),
    }
    rows = []
    for label, make in shapes.items():
        run = tmp / "fast"
        make(run)
        full, fast = _interleaved(run, rounds)
        inside = in_process(run, max(rounds, 5))
        rows.append({"shape": label, "full": full, "fast": fast, "in_process": inside,
                     "in_process_x": inside["fast"] / inside["full"], "wall_x": fast["s"] / full["s"],
                     "cpu_x": fast["cpu_s"] / full["cpu_s"], "rss_x": fast["rss_mb"] / full["rss_mb"]})
        shutil.rmtree(run)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per line-length file (at least one line)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=("lengths", "fast"), default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out) as scratch:
        tmp = Path(scratch)
        lengths = part_lengths(tmp, args.total_mib, args.rounds) if args.only != "fast" else []
        fast = part_fast(tmp, args.rounds) if args.only != "lengths" else []
    if args.json:
        print(json.dumps({"lengths": lengths, "fast": fast}, indent=1))
        return 0
    if lengths:
        print(f"start-up and a 1 KiB file: {lengths[0]['start_cpu_s']:.2f} s CPU, {lengths[0]['start_rss_mb']:.0f} MB "
              "(CPU taken off before dividing by the size)\n")
        print("| line length | file | wall | CPU | CPU s per GiB | in process: CPU s per GiB | peak RSS |\n"
              "|---:|---:|---:|---:|---:|---:|---:|")
        for r in lengths:
            print(f"| {r['line_mib']} MiB | {r['file_mib']:.0f} MiB | {r['s']:.2f} s | {r['cpu_s']:.2f} s | "
                  f"{r['cpu_s_per_gib']:.2f} | {r['in_process_s_per_gib']:.2f} | {r['rss_mb']:.0f} MB |")
    if fast:
        print("\n| file | full: wall / CPU / RSS | --fast: wall / CPU / RSS | × wall | × CPU | × RSS | in process: "
              "full / --fast CPU | × |\n|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in fast:
            a, b = r["full"], r["fast"]
            print(f"| {r['shape']} | {a['s']:.2f} s / {a['cpu_s']:.2f} s / {a['rss_mb']:.0f} MB | "
                  f"{b['s']:.2f} s / {b['cpu_s']:.2f} s / {b['rss_mb']:.0f} MB | {r['wall_x']:.2f} | "
                  f"{r['cpu_x']:.2f} | {r['rss_x']:.2f} | {r['in_process']['full']:.2f} s / "
                  f"{r['in_process']['fast']:.2f} s | {r['in_process_x']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
