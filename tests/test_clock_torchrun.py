"""Real ``torchrun`` jobs on two "hosts" with clocks of their own (docs/clock.md): gloo on CPU, 4 ranks,
ranks 0-1 host ``host-a``, ranks 2-3 ``host-b`` (``OTEL_TRAIN_HOST``), each host's clock set by Debian's
libfaketime (``LD_PRELOAD``, ``FAKETIME`` per rank through tests/faketime_launch.py): host a +5 s,
host b -5 s running 100 ppm fast. The estimate recovers the offset; the arrival-order straggler and
the hang culprit are those of the same job on honest clocks; ``watch`` follows the skewed job live.

``make test`` installs the ``faketime`` package (its ``test`` prerequisites); without it these skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize

LAUNCH = Path(__file__).resolve().parent / "faketime_launch.py"
LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
CLI = Path(sys.executable).with_name("otel-train")
FAKE = {"CLOCK_FAKE_A": "+5s", "CLOCK_FAKE_B": "-5s x1.0001"}
HONEST = {"CLOCK_FAKE_A": "", "CLOCK_FAKE_B": ""}
TRUE_OFFSET_MS = -10_000.0  # host b - host a at host b's start; host b's clock then gains 100 ppm
COMMON = ("--batch-size", "8", "--hidden", "16", "--num-workers", "0", "--eval-every", "0",
          "--checkpoint-every", "0")

pytestmark = pytest.mark.skipif(not Path(LIB).exists(),
                                reason="libfaketime is not installed (apt-get install faketime; make test does)")


def _env(clocks: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR", "TORCH_NCCL", "FAKETIME"))}
    env.update(OMP_NUM_THREADS="1", OTEL_TRAIN_HEARTBEAT_S="0", **clocks)
    return env


def _cmd(save: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(LAUNCH),
            "--save-path", str(save), *COMMON, *args]


def _start(save: Path, clocks: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """A job started (the hang test runs its honest and skewed twins side by side: their ranks sleep)."""
    return subprocess.Popen(_cmd(save, *args), cwd=save.parent, env=_env(clocks), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(job: subprocess.Popen[str], save: Path, ok: bool = True) -> dict:
    try:
        _, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
    if ok:
        assert job.returncode == 0, err[-4000:]
    return summarize(save)


def _hosts(summary: dict) -> dict[int, str]:
    return {p["rank"]: p["host"] for p in summary["processes"]}


def _check_clock(summary: dict, span_s: float, samples: int = 20) -> dict:
    rows = {r["host"]: r for r in summary["clock"]}
    assert sorted(rows) == ["host-a", "host-b"] and rows["host-a"]["offset_ms"] == 0.0
    b = rows["host-b"]
    # Host b's clock gained up to 100 ppm x the time since its process started (before the first record).
    assert TRUE_OFFSET_MS - 8.0 <= b["offset_ms"] <= TRUE_OFFSET_MS + 0.1 * (span_s + 60.0) + 8.0, b
    assert b["samples"] >= samples
    skew = [f for f in summary["findings"] if f["kind"] == "clock_skew"]
    assert [(f["host"], f["rank"]) for f in skew] == [("host-b", 2)]
    return b


STRAGGLER_STEPS = 160


def test_faketime_straggler_is_the_honest_one(tmp_path: Path) -> None:
    # 160 steps of ~0.2 s: the collectives span more than the 20 s a drift needs (docs/clock.md).
    args = ("--steps", str(STRAGGLER_STEPS), "--slow-rank", "1", "--slow-phase", "data_fetch", "--slow-ms", "150")
    # One after the other: side by side, each job's collectives met the other's load and the drift's
    # fit on host b came out at 62 ppm (residual 5.9 ms) in a fresh-clone run. The honest twin, which
    # fits no drift (one clock), needs only enough steps for its straggler finding with its arrival
    # evidence: last at >= 90 % of the collectives, and 6 of them are start-up ones outside any step. At
    # 60 steps that left no margin (60 / 66 = 0.91): beside a busy loop rank 1 was last at 59 / 66 and
    # the finding lost its comm clause. At 100 steps it can miss 4.
    honest_args = ("--steps", "100", *args[2:])
    honest = _finish(_start(tmp_path / "honest", HONEST, *honest_args), tmp_path / "honest")
    skewed = _finish(_start(tmp_path / "skewed", FAKE, *args), tmp_path / "skewed")
    assert _hosts(skewed) == {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}
    h_rows = {r["host"]: r for r in honest["clock"]}
    assert abs(h_rows["host-b"]["offset_ms"]) < 10.0  # one machine: the same clock
    b = _check_clock(skewed, STRAGGLER_STEPS * 0.3)
    # Host b runs 100 ppm fast (x1.0001). The fit's own scatter bounds what it can tell: a residual of
    # r ms over the T s the collectives span moves the slope by about r / T ms per s (250 steps, T about
    # 50 s, beside a busy loop: residual 8.3 ms, 168 ppm; quiet: about 1 ms, within 10 ppm).
    span_s = STRAGGLER_STEPS * 0.2
    slack_ppm = 30.0 + 1000.0 * b["residual_ms"] / span_s
    assert abs(b["drift_ppm"] - 100.0) <= slack_ppm, (b, slack_ppm)
    (tmp_path / "clock.json").write_text(json.dumps({"honest": honest["clock"], "skewed": skewed["clock"]}))

    def stragglers(s: dict) -> list[tuple]:
        return [(f["rank"], f["phase"], f.get("comm", {}).get("waiting")) for f in s["findings"] if f["kind"] == "straggler"]

    assert stragglers(skewed) == stragglers(honest) and stragglers(honest)[0][:2] == (1, "data_fetch")
    assert stragglers(honest)[0][2] == [0, 2, 3]  # every peer waits on it, on both hosts
    print(f"host-b estimate: {b}")


HANG = ("--steps", "12", "--hang-rank", "1", "--hang-step", "6", "--hang-phase", "forward", "--timeout-s", "15")


def test_faketime_hang_culprit_is_the_honest_one_and_watch_sees_it(tmp_path: Path) -> None:
    honest_job = _start(tmp_path / "honest", HONEST, *HANG)
    save = tmp_path / "skewed"
    job = subprocess.Popen(_cmd(save, *HANG), cwd=tmp_path, env={**_env(FAKE), "OTEL_TRAIN_STALL_MIN_S": "2"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    watch = subprocess.Popen([str(CLI), "watch", str(save), "--json", "--exit-on", "hang", "--timeout", "150"],
                             cwd=tmp_path, env=_env({}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = watch.communicate(timeout=200)
        job.wait(timeout=200)
    finally:
        for proc in (job, watch):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    honest = _finish(honest_job, tmp_path / "honest", ok=False)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    live = [e["finding"] for e in events if e.get("type") == "finding"]
    hangs = [f for f in live if f["kind"] == "hang"]
    assert watch.returncode == 3 and hangs, (out[-3000:], err[-3000:])
    assert (hangs[0]["rank"], hangs[0]["victims"]) == (1, [0, 2, 3]), (json.dumps(hangs[0]), out[-3000:])
    assert [f["kind"] for f in live if f["kind"] not in ("clock_skew", "hang")] == []  # no false finding before
    skewed = summarize(save)
    _check_clock(skewed, 12 * 0.1, samples=4)

    def culprit(s: dict) -> list[tuple]:
        return [(f["kind"], f["rank"], f.get("comm", {}).get("waiting")) for f in s["findings"]
                if f["kind"] in ("hang", "crash")]

    assert culprit(skewed) == culprit(honest) and culprit(honest)[0][1] == 1
    hang = next(f for f in skewed["findings"] if f["kind"] in ("hang", "crash"))
    # "waiting since": the first waiter on the reference clock (host a's, +5 s), not host b's raw -5 s.
    run = load_run(save)
    graph = run.comm[("training", 0)]
    ops = [o for r, o in graph.collectives[(hang["comm"]["group"], hang["comm"]["seq"])].items()
           if r in hang["comm"]["waiting"]]
    aligned, raw = _hms(min(graph.at(o) for o in ops)), _hms(min(o.start for o in ops))
    assert aligned != raw and aligned in hang["message"] and raw not in hang["message"], hang["message"]


def _hms(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S")
