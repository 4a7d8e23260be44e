"""``otel-train watch`` at scale, and what the watchdog costs a span.

1. Ingest: a synthetic run of N ranks written live at 2 steps/s × 8 spans per step (a ``step`` and 7
   phases: 32 records per rank per second), with a follower doing what ``otel-train watch`` does
   (``LiveRun.poll`` every 0.5 s) in its own process from before the first file appears. Reports
   the follower's CPU (share of one core) and the delay from a write to the poll that took it in
   (measured on the last record of each write: every rank writes a step's 16 lines in one call).
2. Hang: after a warm-up, one rank stops inside ``forward`` and every other rank waits in
   ``backward``; each keeps writing what its watchdog would (heartbeats, stall records at the
   threshold); reports the time from the culprit's ``forward`` start to the hang finding.
3. Span cost with the watchdog on and off, interleaved blocks in one process; what an ended span costs
   the hot path (a deque append) and the watchdog's thread (its sketch), against ``ddsketch``.

    .venv/bin/python benchmarks/watch_scale.py [--ranks 256,1024] [--seconds 30] [--hang-ranks 64,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

from otel_train import schema

PHASES = ("data_fetch", "batch_to_device", "forward", "backward", "optimizer", "hooks.before_step", "hooks.after_step")
STEPS_PER_S = 2.0
SETTINGS = {"watchdog": True, "heartbeat_s": 10.0, "stall_min_s": 10.0, "stall_factor": 5.0}
POLL_S = 0.5


class SimRank:
    """One simulated rank: an open file and the JSON fragments every record of it shares."""

    def __init__(self, logs: Path, rank: int, world: int, stamp: str) -> None:
        name = schema.trace_file_name("training", rank, stamp, secrets.token_hex(3))
        self.fd = os.open(logs / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank = rank
        self.seq = 0
        self.base = (f'"rank":{rank},"local_rank":{rank % 8},"world_size":{world},"host":"sim{rank // 8:04d}",'
                     f'"pid":{100000 + rank},"attempt":0,"run_id":"watch-scale","source":"training","tid":{rank + 1}')
        self.step_id = ""
        self.open: list[tuple[str, str, float]] = []
        self.lines = 0

    def line(self, ts: float, kind: str, name: str, sid: str, step: int | None, extra: str = "") -> str:
        self.seq += 1
        event = name + {"span_start": "_start", "span_end": "_end"}.get(kind, "")
        parent = f',"parent_span_id":"{self.step_id}"' if kind.startswith("span") and name != "step" else ""
        at = f',"step":{step},"relative_step":{step}' if step is not None else ""
        return (f'{{"v":1,"ts":{ts:.6f},"kind":"{kind}","event":"{event}","name":"{name}","trace_id":"{0:032x}",'
                f'"span_id":"{sid}"{parent}{at},{self.base},"seq":{self.seq}{extra}}}\n')

    def start(self, ts: float) -> None:
        self.write([self.line(ts, "instant", "process_start", "0" * 16, None,
                              f',"attrs":{{"settings":{json.dumps(SETTINGS)}}}')])

    def step(self, step: int, t0: float, t1: float, stop_at: str | None = None) -> None:
        """Step ``step`` from t0 to t1 as one write; ``stop_at``: leave that phase (and the step) open."""
        self.step_id = secrets.token_hex(8)
        lines = [self.line(t0, "span_start", "step", self.step_id, step)]
        self.open = [("step", self.step_id, t0)]
        slot = (t1 - t0) / (len(PHASES) + 1)
        for i, name in enumerate(PHASES):
            sid, start = secrets.token_hex(8), t0 + (i + 0.5) * slot
            lines.append(self.line(start, "span_start", name, sid, step))
            if name == stop_at:
                self.open.append((name, sid, start))
                self.write(lines)
                return
            lines.append(self.line(start + slot * 0.9, "span_end", name, sid, step,
                                   f',"dur_ms":{slot * 900:.3f},"status":"ok"'))
        lines.append(self.line(t1, "span_end", "step", self.step_id, step,
                               f',"dur_ms":{(t1 - t0) * 1000:.3f},"status":"ok"'))
        self.write(lines)

    def watchdog(self, ts: float, stall_for: tuple[str, str, float, float] | None) -> None:
        """What the watchdog of a stuck rank writes: a heartbeat, or a stall record for the open span."""
        if stall_for is None:
            spans = [name for name, _, _ in self.open]
            self.write([self.line(ts, "instant", "heartbeat", "0" * 16, None,
                                  f',"attrs":{{"open":[{{"tid":{self.rank + 1},"spans":{json.dumps(spans)}}}]}}')])
        else:
            name, sid, start, threshold = stall_for
            stacks = [{"tid": self.rank + 1, "thread": "MainThread", "frames": ["train.py:88:main", f"train.py:40:{name}"]}]
            attrs = {"span": name, "open_s": round(ts - start, 3), "threshold_s": threshold, "tid": self.rank + 1,
                     "stacks": stacks}
            self.write([self.line(ts, "instant", "stall", sid, None, f',"attrs":{json.dumps(attrs)}')])

    def write(self, lines: list[str]) -> None:
        os.write(self.fd, "".join(lines).encode())
        self.lines += len(lines)


def write_run(run: Path, ranks: int, seconds: float, hang_after: float | None) -> dict:
    """Write ``ranks`` ranks live for ``seconds`` (or until a hang has run ``seconds`` past injection)."""
    logs = run / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sims = [SimRank(logs, r, ranks, stamp) for r in range(ranks)]
    now = time.time()
    for s in sims:
        s.start(now)
    period = 1.0 / STEPS_PER_S
    start = time.time()
    step, inject = 0, None
    culprit = ranks // 3
    while True:
        t0 = start + step * period
        if hang_after is not None and t0 - start >= hang_after:
            inject = _hang(sims, step, t0, period, culprit)
            break
        for i, s in enumerate(sims):  # ranks finish their steps spread over the period, as in life
            _sleep_until(t0 + period * (i + 1) / len(sims))
            now = time.time()  # the step's last record carries the moment it is written
            s.step(step, now - period, now)
        step += 1
        if time.time() - start >= seconds:
            break
    elapsed = time.time() - start
    if inject is not None:
        _stuck(sims, culprit, inject, seconds)
    for s in sims:
        os.close(s.fd)
    rate = sum(s.lines for s in sims) / elapsed
    return {"ranks": ranks, "steps": step, "inject_ts": inject, "culprit": culprit, "records_per_s": rate}


def _hang(sims: list[SimRank], step: int, t0: float, period: float, culprit: int) -> float:
    _sleep_until(t0 + period)
    now = time.time()
    for s in sims:
        s.step(step, now - period, now, stop_at="forward" if s.rank == culprit else "backward")
    return next(start for name, _, start in sims[culprit].open if name == "forward")


def _stuck(sims: list[SimRank], culprit: int, inject: float, seconds: float) -> None:
    """Stuck ranks: heartbeats every heartbeat_s, a stall record once the open span passes its threshold."""
    threshold = SETTINGS["stall_min_s"]  # max(stall_min_s, 5 × a p99 of ~60 ms)
    stalled, beat = False, inject
    while time.time() < inject + seconds:
        now = time.time()
        if not stalled and now >= inject + threshold + 0.5:  # the watchdog looks about once a second
            for s in sims:
                name, sid, start = s.open[-1]
                s.watchdog(now, (name, sid, start, threshold))
            stalled = True
        if now >= beat + SETTINGS["heartbeat_s"]:
            for s in sims:
                s.watchdog(now, None)
            beat = now
        time.sleep(0.05)


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


# ---------------------------------------------------------------------------------------------
# The follower: what `otel-train watch --json` does, instrumented.


def follow(run: Path, seconds: float, warmup: float, until_hang: bool) -> dict:
    from otel_train.analysis.live import LiveRun
    from otel_train.analysis.records import Tail

    delays: list[float] = []

    class TimedTail(Tail):
        def poll(self):  # type: ignore[no-untyped-def]
            batches = super().poll()
            now = time.time()
            if now >= begin + warmup:
                delays.extend(now - recs[-1].ts for _, recs in batches)
            return batches

    live = LiveRun(run, warn=lambda m: None)
    live.tail = TimedTail(live.tail.path, live.tail.bad)
    begin = time.time()
    cpu0 = wall0 = None
    found = None
    while time.time() - begin < seconds:
        if cpu0 is None and time.time() - begin >= warmup:
            cpu0, wall0 = _cpu(), time.time()
        for event in live.poll():
            if event["type"] == "finding" and event["finding"]["kind"] == "hang" and found is None:
                found = {"ts": event["ts"], "rank": event["finding"]["rank"], "phase": event["finding"]["phase"]}
        if until_hang and found is not None:
            break
        time.sleep(POLL_S)
    out: dict = {"processes": len(live.procs), "finding": found}
    if cpu0 is not None and wall0 is not None:
        out["cpu_share"] = (_cpu() - cpu0) / (time.time() - wall0)
    if delays:
        delays.sort()
        out["delay_s"] = {"p50": delays[len(delays) // 2], "p99": delays[int(len(delays) * 0.99)], "max": delays[-1],
                          "n": len(delays)}
    return out


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_case(root: Path, ranks: int, seconds: float, hang_after: float | None) -> dict:
    run = root / f"run-{ranks}-{'hang' if hang_after is not None else 'ingest'}"
    shutil.rmtree(run, ignore_errors=True)
    warmup = 5.0
    follower = subprocess.Popen(
        [sys.executable, __file__, "--follow", str(run), "--seconds", str(seconds + (hang_after or 0) + 10),
         "--warmup", str(warmup), *(["--until-hang"] if hang_after is not None else [])],
        stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the follower is waiting before the first file appears, as watch does
    written = write_run(run, ranks, seconds, hang_after)
    out, _ = follower.communicate(timeout=seconds + (hang_after or 0) + 60)
    result = {**written, **json.loads(out)}
    shutil.rmtree(run, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------
# Span cost with the watchdog on and off.


def span_cost(spans: int, rounds: int) -> dict:
    import otel_train as ot

    def block(watchdog: bool, save: str) -> float:
        ot.init(save_path=save, enabled=True, watchdog=watchdog, max_file_size_mb=64, backup_count=1)
        ot.set_step(1)
        span = ot.log_trace_span
        t = time.perf_counter()
        for _ in range(spans):
            with span("forward"):
                pass
        elapsed = time.perf_counter() - t
        ot.shutdown()
        return elapsed / spans * 1e6

    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for watchdog in ((True, False) if i % 2 == 0 else (False, True)):
                times[watchdog].append(block(watchdog, os.path.join(tmp, f"{watchdog}-{i}")))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    # Each round's two blocks ran back to back: their ratio cancels what the shared machine did meanwhile.
    paired = statistics.median(a / b for a, b in zip(times[True], times[False]))
    return {"on_us": on, "off_us": off, "ratio": paired, "rounds": rounds, "spans": spans}


def sketch_cost() -> dict:
    """ns per ended span: the hot path's deque append; the watchdog thread's look at it (drained from the
    queue, counted into its sketch, its end noted for its open parent: ``Watchdog.check``'s per-span
    work); and what ``ddsketch`` (which the hot path could have called instead) takes to add one value."""
    from collections import deque
    from types import SimpleNamespace

    from otel_train.watchdog import Watchdog

    parent = SimpleNamespace(span_id=7)
    span = SimpleNamespace(_name="forward", _start_time=1_000_000_000, _end_time=1_012_345_678, _parent=parent)
    dog = Watchdog(None, heartbeat_s=0, stall_min_s=10, stall_factor=5)  # type: ignore[arg-type] - no look writes
    ended: deque = dog.ended
    n = 8_000  # the queue's bound is 8,192: what one look may find
    out = {"append_ns": min(timeit.repeat(lambda: ended.append(span), number=n, repeat=5)) / n * 1e9}
    step = (7, "step", 0, 1)  # the parent, open and innermost on its thread
    best = float("inf")
    for _ in range(50):
        ended.clear()
        ended.extend([span] * n)
        t = time.perf_counter()
        spans = dog._drain()
        dog.sketch.count(spans)
        dog._innermost_since([step], {1: step}, spans)
        best = min(best, time.perf_counter() - t)
    out["count_ns"] = best / n * 1e9
    try:
        from ddsketch import DDSketch
    except ImportError:
        return out
    dd = DDSketch(relative_accuracy=0.01)
    out["ddsketch_ns"] = min(timeit.repeat(lambda: dd.add(12_345_678.0), number=n, repeat=5)) / n * 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="256,1024", help="ingest runs (comma list)")
    p.add_argument("--hang-ranks", default="64,1024", help="hang runs (comma list)")
    p.add_argument("--seconds", type=float, default=30.0, help="ingest duration; a hang's warm-up")
    p.add_argument("--spans", type=int, default=10_000, help="spans per block for the span cost")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--follow", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--until-hang", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.follow is not None:
        print(json.dumps(follow(a.follow, a.seconds, a.warmup, a.until_hang)))
        return
    root = Path(tempfile.mkdtemp(prefix="watch-scale-"))
    try:
        print("| ranks | records/s written | watch CPU (one core) | delay p50 / p99 / max (s) |")
        print("|---:|---:|---:|---|")
        for ranks in (int(r) for r in a.ranks.split(",") if r):
            r = run_case(root, ranks, a.seconds, None)
            d = r.get("delay_s", {})
            print(f"| {ranks} | {r['records_per_s']:,.0f} | {r.get('cpu_share', float('nan')):.0%} | "
                  f"{d.get('p50', float('nan')):.2f} / {d.get('p99', float('nan')):.2f} / {d.get('max', float('nan')):.2f} |",
                  flush=True)
        print()
        print("| ranks | culprit | named | time from the fault to the finding (s) | target (s) |")
        print("|---:|---|---|---:|---:|")
        for ranks in (int(r) for r in a.hang_ranks.split(",") if r):
            r = run_case(root, ranks, 25.0, min(a.seconds, 20.0))
            f = r["finding"] or {}
            latency = f["ts"] - r["inject_ts"] if f else float("nan")
            target = SETTINGS["stall_min_s"] + 5
            print(f"| {ranks} | rank {r['culprit']} forward | rank {f.get('rank')} {f.get('phase')} | "
                  f"{latency:.1f} | {target:.0f} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    cost = span_cost(a.spans, a.rounds)
    print(f"span cost: watchdog on {cost['on_us']:.2f} µs, off {cost['off_us']:.2f} µs, "
          f"on/off {cost['ratio']:.3f} (median of {cost['rounds']} paired, interleaved blocks of {cost['spans']} spans)")
    sk = sketch_cost()
    print(f"per ended span: hot path deque append {sk['append_ns']:.0f} ns; watchdog thread's look (drain, sketch count, parent's end) "
          f"{sk['count_ns']:.0f} ns" + (f"; ddsketch DDSketch.add {sk['ddsketch_ns']:.0f} ns" if "ddsketch_ns" in sk else ""))


if __name__ == "__main__":
    main()
