"""Windows and repeat reads (issue 20), process to process, with the machine's load beside every figure.

Three parts (``--parts``, default all):

* ``repeat``: on the 16-rank x 4000-step run of ``analysis_throughput.py`` (320 MB), each command read
  first (the run's read cache removed: ``analysis_throughput.drop_cache``) and then again: ``summarize``, ``stats``, ``whatif``,
  ``diff A A`` (each ``--json``) and both exports; the second read is served from the remembered result
  (docs/analysis.md, "Reading"). Also each command after *another* command filled the read cache (its
  own result not remembered yet): what the read cache alone gives.
* ``windows``: a 10-step ``--steps`` window of ``summarize --json`` and ``export -f perfetto`` (cache
  removed first) on the 320 MB run and on the 1,024-rank scale simulation (``scale_sim.py``) at two
  sizes ``--factor`` apart: the target is <= 2 s whatever the file size.
* ``whatif``: ``whatif --json`` and ``diff A A --json`` on a 200-step ``--steps`` window of the 320 MB run
  against the same command on the whole run (cache removed before each), and ``whatif(load_run(...))``
  in this process (the read and the model without the CLI's start-up): issue 17's target is a
  ``whatif`` window in <= 0.2x the full run's time.

Every row is the median (and range) of ``--repeat`` rounds, interleaved, with the 1-minute load average
before and after the row (other work on this shared VM moves the seconds). A remembered result is
kept for the code that made it: while the package's sources are being edited, time a frozen copy
(``--cli``) or every second read is a first one.

    .venv/bin/python benchmarks/windows.py [--parts repeat,windows,whatif] [--repeat 3] [--kib 128] [--factor 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import analysis_throughput
from analysis_throughput import bench_env, cli, drop_cache, generate  # noqa: E402 - benchmarks/ on sys.path

from otel_train import schema

Row = tuple[str, list[float], list[float]]  # what, seconds per round, load before/after per round


def _load() -> float:
    return os.getloadavg()[0]


def _spread(values: list[float], fmt: str = ".2f") -> str:
    mid = statistics.median(values)
    return format(mid, fmt) if len(values) == 1 else f"{mid:{fmt}} ({min(values):{fmt}} – {max(values):{fmt}})"


def _clear(run: Path) -> None:
    drop_cache(run)


def repeat_commands(run: Path, out: Path) -> list[tuple[str, list[str]]]:
    """The commands issue 20 asks a second read of: (label, arguments)."""
    return [("summarize --json", ["summarize", str(run), "--json"]),
            ("stats --json", ["stats", str(run), "--json"]),
            ("whatif --json", ["whatif", str(run), "--json"]),
            ("diff A A --json", ["diff", str(run), str(run), "--json"]),
            ("export -f chrome", ["export", str(run), "-f", "chrome", "-o", str(out / "repeat.json")]),
            ("export -f perfetto", ["export", str(run), "-f", "perfetto", "-o", str(out / "repeat.pftrace")])]


def repeat_round(run: Path, out: Path, env: dict[str, str]) -> dict[str, float]:
    """One round: per command, first read (no cache), second read; then, with the read cache filled by
    ``summarize`` and no result remembered, each other command (what the read cache alone gives)."""
    got: dict[str, float] = {}
    commands = repeat_commands(run, out)
    for label, args in commands:
        _clear(run)
        got[f"`{label}`: first read"] = cli(*args, env=env)[0]
        got[f"`{label}`: second read"] = cli(*args, env=env)[0]
    _clear(run)
    cli("summarize", str(run), "--json", env=env)
    for label, args in commands[1:]:
        got[f"`{label}` after `summarize` (read cache only)"] = cli(*args, env=env)[0]
    return got


def windows_round(runs: list[tuple[str, Path, int]], out: Path, env: dict[str, str]) -> dict[str, float]:
    """One round of 10-step windows from each run's middle step: summarize and the Perfetto export."""
    got: dict[str, float] = {}
    for label, run, middle in runs:
        steps = f"{middle}-{middle + 9}"
        for what, args in (("summarize --json", ["summarize", str(run), "--json"]),
                           ("export -f perfetto", ["export", str(run), "-f", "perfetto", "-o", str(out / "w.pftrace")])):
            _clear(run)
            got[f"`{what} --steps {steps}`, {label}"] = cli(*args, "--steps", steps, env=env)[0]
    return got


WHATIF_WINDOW = (1900, 2099)
"""The 200-step window of the 16-rank x 4000-step run that issue 17 times (its middle)."""


def whatif_round(run: Path, env: dict[str, str]) -> dict[str, float]:
    """One round: ``whatif`` and ``diff A A`` on the whole run, then on the 200-step window (cache removed)."""
    got: dict[str, float] = {}
    window = "%d-%d" % WHATIF_WINDOW
    for what, args in (("whatif --json", ["whatif", str(run), "--json"]),
                       ("diff A A --json", ["diff", str(run), str(run), "--json"])):
        for label, extra in (("whole run", []), (f"--steps {window}", ["--steps", window])):
            _clear(run)
            got[f"`{what}`, {label}"] = cli(*args, *extra, env=env)[0]
    for label, steps in (("whole run", None), (f"--steps {window}", WHATIF_WINDOW)):
        got[f"`whatif` in process (read + model), {label}"] = _whatif_in_process(run, steps)
    return got


def _whatif_in_process(run: Path, steps: tuple[int, int] | None) -> float:
    """Seconds of ``whatif(load_run(run, steps))`` in this process (no read cache; imports done):
    the window's read and model without the CLI's start-up."""
    from otel_train.analysis.spans import load_run
    from otel_train.analysis.whatif import whatif

    t = time.perf_counter()
    whatif(load_run(run, steps=steps, cache=False))
    return time.perf_counter() - t


def whatif_table(rows: list[Row]) -> list[str]:
    def ratio(what: str, secs: dict[str, list[float]]) -> list[float]:
        if "--steps" not in what:
            return []
        return [a / b for a, b in zip(secs[what], secs[what.rpartition(", ")[0] + ", whole run"])]

    def target(what: str, mid: float) -> str:
        return f"≤ 0.2×: **{'met' if mid <= 0.2 else 'missed'}**" if what.startswith("`whatif") else ""

    return _ratio_table(rows, "| 320 MB, 16 ranks × 4000 steps (cache removed) | seconds | × the whole run "
                              "| load (1 min) | target |", ratio, target, ".2f")


def _ratio_table(rows: list[Row], header: str, ratio, target, fmt: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Rows with their seconds, a ratio per round (``ratio(what, seconds by row)``; none: empty) and the
    target ``target(what, median ratio)`` says."""
    secs = {what: s for what, s, _ in rows}
    out = [header, "|---|---:|---:|---:|---|"]
    for what, s, load in rows:
        ratios = ratio(what, secs)
        shown = _spread(ratios, fmt) + "×" if ratios else ""
        goal = target(what, statistics.median(ratios)) if ratios else ""
        out.append(f"| {what} | {_spread(s)} | {shown} | {min(load):.1f} – {max(load):.1f} | {goal} |")
    return out


def rounds(fn, repeat: int) -> list[Row]:  # type: ignore[no-untyped-def]
    """``fn()`` ``repeat`` times: per row its seconds and the load before and after each round."""
    seconds: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}
    for _ in range(repeat):
        before = _load()
        for what, s in fn().items():
            seconds.setdefault(what, []).append(s)
            loads.setdefault(what, []).extend([before, _load()])
    return [(what, seconds[what], loads[what]) for what in seconds]


def repeat_table(rows: list[Row]) -> list[str]:
    def ratio(what: str, secs: dict[str, list[float]]) -> list[float]:
        first = secs.get(what.replace("second read", "first read")) if what.endswith("second read") else None
        return [a / b for a, b in zip(first, secs[what])] if first else []

    def target(what: str, mid: float) -> str:
        return f"≥ 5×: **{'met' if mid >= 5 else 'missed'}**"

    return _ratio_table(rows, "| what (320 MB, 16 ranks × 4000 steps) | seconds | second read × faster "
                              "| load (1 min) | target |", ratio, target, ".1f")


def windows_table(rows: list[Row], sizes: dict[str, str]) -> list[str]:
    out = ["| 10-step window (CLI, cache removed) | run | seconds | load (1 min) | target |", "|---|---|---:|---:|---|"]
    for what, s, load in rows:
        cmd, _, label = what.rpartition(", ")
        target = f"≤ 2 s: **{'met' if statistics.median(s) <= 2 else 'missed'}**" if "1,024" in label else ""
        out.append(f"| {cmd} | {sizes[label]} | {_spread(s)} | {min(load):.1f} – {max(load):.1f} | {target} |")
    return out


def _size(run: Path) -> float:
    return sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="repeat,windows,whatif")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kib", type=int, default=128, help="KiB per rank of the smaller 1,024-rank run")
    parser.add_argument("--factor", type=int, default=8)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-bench")
    parser.add_argument("--scale-cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-scale")
    parser.add_argument("--cli", type=Path, default=None,
                        help="the otel-train executable to time (default: the venv's); e.g. one that runs a frozen "
                             "copy of the code, so that edits made meanwhile do not change the code a result is kept for")
    args = parser.parse_args()
    if args.cli is not None:
        analysis_throughput.CLI = args.cli
    parts = set(args.parts.split(","))
    out = args.cache / "out"
    out.mkdir(parents=True, exist_ok=True)
    env = bench_env(args.cache)
    run = generate(args.cache, 16, 4000)
    cli("summarize", str(generate(args.cache, 2, 20)), "--json", env=env)  # bytecode written first
    print(f"{os.cpu_count()} CPUs, load {_load():.1f}", file=sys.stderr)
    if "repeat" in parts:
        print("\n".join(repeat_table(rounds(lambda: repeat_round(run, out, env), args.repeat))) + "\n")
    if "windows" in parts:
        import scale_sim

        runs = [("16 × 4000", run, 2000)]
        sizes = {"16 × 4000": f"16 ranks × 4000 steps, {_size(run):.0f} MB"}
        for kib in (args.kib, args.factor * args.kib):
            big = scale_sim.generate(args.scale_cache, 1024, kib, 517, 0.0)
            steps = max(2, kib * 1024 // (scale_sim.RECORD_BYTES * 11))
            label = f"1,024 × {kib} KiB"
            runs.append((label, big, steps // 2 - 5))
            sizes[label] = f"1,024 ranks × {steps} steps, {_size(big):.0f} MB"
        print("\n".join(windows_table(rounds(lambda: windows_round(runs, out, env), args.repeat), sizes)))
    if "whatif" in parts:
        print("\n".join(whatif_table(rounds(lambda: whatif_round(run, env), args.repeat))))
    for f in out.glob("repeat.*"):
        f.unlink()


if __name__ == "__main__":
    main()
