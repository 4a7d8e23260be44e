"""`make demo`: four short 4-rank CPU jobs, each diagnosed on screen (docs/demo.md).

1. a clean run: no findings, what-if ≈ its ideal;
2. the same job with rank 2 slowed by 40 ms in data_fetch: the straggler and what it costs;
3. the same job where rank 1 hangs in forward, watched live by `otel-train watch` beside it: the
   culprit, its phase and its stack, seconds after the hang began;
4. the same job where rank 3 calls broadcast where the others call all_reduce: the desync, with the
   group, the sequence number and both ops;
5. (``--pp 2``, the default) a pipeline job, 2 stages x 2 data-parallel, where both ranks of stage 1
   are slower in every microbatch's forward: the 3-D what-if table (``whatif --method typical``) and
   the data-parallel rank x pipeline stage heatmap (``whatif --plot``).

Jobs 1-4 are `torchrun --standalone --nproc_per_node=4 examples/train_ddp.py`, job 5
`examples/train_parallel.py --mode pp` (gloo on CPU); the answers come from the real CLI's output,
printed short enough for a terminal and a CI log.

    python examples/demo.py [--out runs/demo] [--only clean] [--pp 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from otel_train.analysis.stacks import describe_stack
from otel_train.cli._text import printable

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_ddp.py"
PARALLEL = HERE / "train_parallel.py"
RANKS = 4
COMMON = ("--steps", "30", "--eval-every", "0", "--checkpoint-every", "0", "--hidden", "128")
PIPELINE = ("--mode", "pp", "--schedule", "1f1b", "--steps", "10", "--gpu-wait-ms", "20")
"""Job 5: 1F1B over 4 microbatches, each stage waiting 20 ms (forward) and 40 ms (backward) per
microbatch on a pretend device, so that its step is steady on a busy CPU; stage 1's forward then
waits 40 ms more (3x its stage 0 twin's)."""
JOB_TIMEOUT_S = 60.0


def say(text: str = "") -> None:
    print(text, flush=True)


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "otel_train.cli", *args]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return out | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


@contextmanager
def job(path: Path, *args: str, script: Path = TRAIN, common: tuple[str, ...] = COMMON,
        **extra_env: str) -> Iterator[subprocess.Popen[bytes]]:
    """A 4-rank torchrun job of ``script`` writing to ``path``, in a session of its own (killed whole
    on the way out)."""
    kill_ranks(path)  # a rank left over from an interrupted demo would write into this run
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path.parent / f"{path.name}.log", "wb")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", str(script),
           "--save-path", str(path), *common, *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(**extra_env), start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kill_ranks(path)
        log.close()


def kill_ranks(path: Path) -> None:
    """Kill every rank of the job still alive: torchrun starts each rank in a session of its own, so
    killing its process group leaves a hung rank behind (it would write into the next demo's run)."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            if proc.name.isdigit() and str(path).encode() in args:
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def cli_json(*args: str) -> Any:
    out = subprocess.run(command(*args, "--json"), capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"demo: `otel-train {' '.join(args)}` failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def show_findings(path: Path, kinds: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    say(f"$ otel-train summarize {path}")
    found = [f for f in cli_json("summarize", str(path))["findings"] if not kinds or f["kind"] in kinds]
    if not found:
        say("  Findings: none")
    for f in found:
        say(f"  {f['kind']}: {printable(f['message'])}")
    return found


def show_whatif(path: Path) -> None:
    say(f"$ otel-train whatif {path}")
    w = cli_json("whatif", str(path))
    if not w.get("steps"):
        say("  (no steps to replay)")
        return
    ms = w["step_ms"]
    say(f"  step {ms['actual']:.1f} ms, ideal {ms['ideal']:.1f} ms: {w['slowdown']:.2f}x its ideal")
    top = (w.get("by_rank_phase") or [])[:1]
    for r in top:
        cost = ms["actual"] - ms["actual"] / r["slowdown"] if r.get("slowdown") else 0.0
        say(f"  without rank {r['rank']}'s {r['phase']} slowness: {cost:.1f} ms ({100 * cost / ms['actual']:.0f} %) "
            "faster per step")


def clean(out: Path) -> None:
    say("== 1. A clean run")
    with job(out / "clean", "--cpu-wait") as proc:  # each step's wait for a CPU: a busy machine's stragglers
        proc.wait(JOB_TIMEOUT_S)
    show_findings(out / "clean")
    show_whatif(out / "clean")


def straggler(out: Path) -> None:
    say("\n== 2. Rank 2 is 40 ms slower in data_fetch on every step")
    with job(out / "straggler", "--slow-rank", "2", "--slow-phase", "data_fetch", "--slow-ms", "40",
             "--cpu-wait") as proc:
        proc.wait(JOB_TIMEOUT_S)
    show_findings(out / "straggler", ("straggler",))
    show_whatif(out / "straggler")


def hang(out: Path) -> None:
    say("\n== 3. Rank 1 hangs in forward at step 8; otel-train watch runs beside the job")
    path = out / "hang"
    with job(path, "--hang-rank", "1", "--hang-step", "8", "--hang-phase", "forward", "--timeout-s", "30",
             "--cpu-wait", OTEL_TRAIN_STALL_MIN_S="3"):
        say(f"$ otel-train watch {path} --stacks --exit-on hang")
        watch = subprocess.run(command("watch", str(path), "--json", "--stacks", "--exit-on", "hang",
                                       "--timeout", str(JOB_TIMEOUT_S)), capture_output=True, text=True,
                               timeout=JOB_TIMEOUT_S + 30)
        (path / "analysis").mkdir(exist_ok=True)
        (path / "analysis" / "watch.jsonl").write_text(watch.stdout)  # what watch said live, as it said it
        for line in watch.stdout.splitlines():
            event = json.loads(line)
            if event["type"] == "finding":
                f = event["finding"]
                say(f"  {f['kind']}: {printable(f['message'])}")
                for stack in (f.get("stacks") or [])[:1]:
                    say(f"    stack: {printable(describe_stack(stack))}")
                if f.get("since"):
                    say(f"  (named {event['ts'] - f['since']:.1f} s after the ranks stopped; the job is stopped now)")


def desync(out: Path) -> None:
    say("\n== 4. Rank 3 calls broadcast where the others call all_reduce")
    with job(out / "desync", "--fault", "desync-op", "--fault-rank", "3", "--fault-step", "5",
             "--timeout-s", "5", "--cpu-wait") as proc:
        try:
            proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    show_findings(out / "desync", ("desync", "hang"))


def pipeline(out: Path, stages: int) -> None:
    say(f"\n== 5. A pipeline, {stages} stages x {RANKS // stages} data-parallel: stage 1 is 40 ms slower in every "
        "microbatch's forward")
    path = out / "pipeline"
    with job(path, *PIPELINE, "--fault", "slow-stage", "--fault-stage", "1", "--slow-ms", "40", script=PARALLEL,
             common=()) as proc:
        proc.wait(JOB_TIMEOUT_S)
    heat = path / "analysis" / "whatif-heatmap.png"
    say(f"$ otel-train whatif {path} --method typical --plot {heat}")
    done = subprocess.run(command("whatif", str(path), "--method", "typical", "--plot", str(heat)), capture_output=True,
                          text=True, timeout=120, env=env(COLUMNS="98", NO_COLOR="1"))
    if done.returncode != 0:
        raise SystemExit(f"demo: `otel-train whatif {path}` failed: {done.stderr.strip()[-500:]}")
    for line in done.stdout.rstrip().splitlines():
        say(f"  {printable(line)}")


def where(out: Path) -> None:
    trace = out / "straggler" / "analysis" / "structured_trace.json"
    subprocess.run(command("export", str(out / "straggler"), "--output", str(trace)), check=True,
                   capture_output=True, timeout=120)
    heat = out / "straggler" / "analysis" / "whatif.png"
    subprocess.run(command("whatif", str(out / "straggler"), "--json", "--plot", str(heat)), check=True,
                   capture_output=True, timeout=120)
    say("\n== Where to look next")
    say(f"  Perfetto trace of the straggler run: {trace}")
    viewer = os.path.relpath(Path(sys.executable).parent / "vizviewer")
    say(f"  open it at https://ui.perfetto.dev (Open trace file), or offline: {viewer} {trace}")
    say(f"  what-if heatmap (rank x phase) of the straggler run: {heat} (any image viewer)")
    say(f"  trace files: {out}/<run>/structured_logs/  (every run: otel-train summarize / whatif / export)")


def where_pipeline(out: Path) -> None:
    heat = out / "pipeline" / "analysis" / "whatif-heatmap.png"
    say(f"  what-if heatmap (data-parallel rank x pipeline stage) of the pipeline run: {heat}")


SCENARIOS = {"clean": clean, "straggler": straggler, "hang": hang, "desync": desync}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--only", choices=sorted([*SCENARIOS, "pipeline"]), action="append",
                   help="run only these scenarios")
    p.add_argument("--pp", type=int, choices=(0, 2), default=2,
                   help="pipeline stages of job 5 (2: 2 stages x 2 data-parallel; 0: no pipeline job)")
    args = p.parse_args(argv)
    begun = time.monotonic()
    for name, scenario in SCENARIOS.items():
        if not args.only or name in args.only:
            scenario(args.out)
    piped = args.pp > 0 and (not args.only or "pipeline" in args.only)
    if piped:
        pipeline(args.out, args.pp)
    if not args.only or "straggler" in args.only:
        where(args.out)
    elif piped:
        say("\n== Where to look next")
    if piped:
        where_pipeline(args.out)
    say(f"\n(demo took {time.monotonic() - begun:.0f} s)")


if __name__ == "__main__":
    main()
