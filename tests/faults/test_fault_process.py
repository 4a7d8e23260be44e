"""The process around the tracing: its umask, the thread that calls ``init``, the kind of function a
decorator wraps.

What must hold: under ``umask 000`` nothing otel-train creates (run directory, ``structured_logs/``,
``digests/``, ``analysis/``, trace files and segments, digests, exports) is group- or world-writable;
a decorated generator's span covers its iteration (first ``next`` to exhaustion, close or raise);
SIGTERM shuts down cleanly (and says so) however ``init`` was called, from the main thread or not.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from faultlib import assert_clean_end, reported, traces, trials

from otel_train import schema as S

UMASK_CHILD = textwrap.dedent(
    """
    import glob, os, sys, time
    os.umask(0)
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, digest_s=0.05, max_file_size_mb=0.01, backup_count=2)
    for step in range(200):
        with ot.training_step(step), ot.log_trace_span("forward", pad="x" * 100):
            pass
    # A digest to check the mode of: the watchdog writes one every 0.05 s once the writer thread has
    # caught up, which a loaded machine can delay past shutdown's deadline (then none is written).
    end = time.monotonic() + 60
    while not glob.glob(os.path.join(sys.argv[1], "digests", "*.digest.json")) and time.monotonic() < end:
        time.sleep(0.05)
    ot.shutdown(timeout_s=2.0)
    from otel_train.analysis.export import export
    export(sys.argv[1], "chrome")
    export(sys.argv[1], "perfetto", os.path.join(sys.argv[1], "new", "deeper", "trace.pftrace"))
    """
)


def test_umask_000_leaves_nothing_writable_by_others(tmp_path: Path) -> None:
    holds = ("under umask 000: run dir, structured_logs/, digests/, analysis/, an export's new parents 0755; trace "
             "file, rotated segments, digest, exports 0644; none group- or world-writable")
    with reported("umask 000 (run directory, digests, exports)", holds, 1):
        run = tmp_path / "deep" / "run"
        done = subprocess.run([sys.executable, "-c", UMASK_CHILD, str(run)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        made = [tmp_path / "deep", *run.parent.rglob("*")]
        kinds = {p.relative_to(tmp_path).parts[-1] for p in made}
        assert {"structured_logs", "digests", "analysis", "deeper"} <= kinds, sorted(kinds)
        assert any(p.name.endswith(".jsonl.1") for p in made) and any(p.name.endswith(".digest.json") for p in made)
        assert any(p.suffix == ".pftrace" for p in made) and any(p.suffix == ".json" and p.parent.name == "analysis"
                                                                   for p in made)
        modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode) for p in made}
        # The read cache (docs/analysis.md "Reading") is private by design: its pickles are read back
        # only from entries this user owns, and nobody else needs them.
        private = {k for k in modes if ".otel-train-cache" in Path(k).parts}
        wrong = {k: oct(m) for k, m in modes.items()
                 if m != ((0o700 if (tmp_path / k).is_dir() else 0o600) if k in private
                          else (0o755 if (tmp_path / k).is_dir() else 0o644))}
        assert wrong == {}, wrong


GEN_CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, watchdog=False, traces_exporter=sys.argv[2])

    @ot.log_trace_span("batches")
    def batches(n):
        for i in range(n):
            with ot.log_trace_span("load"):
                time.sleep(0.1)
            yield i
        return "done"

    @ot.log_trace_span("failing")
    def failing():
        yield 1
        raise ValueError("bad shard")

    @ot.log_trace_span("abatches")
    async def abatches(n):
        for i in range(n):
            with ot.log_trace_span("aload"):
                await asyncio.sleep(0.1)
            yield i

    with ot.log_trace_span("outer"):
        for item in batches(3):
            with ot.log_trace_span("consume"):
                pass
        for item in batches(5):
            break  # closed early: the span ends at close
        try:
            for item in failing():
                pass
        except ValueError:
            pass

        async def main():
            async for item in abatches(3):
                with ot.log_trace_span("aconsume"):
                    pass
        asyncio.run(main())
    ot.shutdown(timeout_s=1.0)
    """
)


def test_decorated_generators_span_their_iteration(tmp_path: Path) -> None:
    holds = ("@log_trace_span on a generator and an async generator: the span lasts from the first next to "
             "exhaustion (>= 300 ms over 3 x 100 ms), to close when abandoned, to the raise (status error); "
             "spans made in the body are its children, the consumer's are not (lean and SDK paths)")
    with reported("@log_trace_span on generators and async generators", holds, 2):
        for exporters in ("jsonl", "jsonl,console"):
            run = tmp_path / exporters.replace(",", "-")
            done = subprocess.run([sys.executable, "-c", GEN_CHILD, str(run), exporters], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            (trace,) = traces(run)
            assert_clean_end(trace)
            ends = [r for r in trace.records if r[S.KIND] == S.SPAN_END]
            by_name: dict[str, list[dict]] = {}
            for r in ends:
                by_name.setdefault(r[S.NAME], []).append(r)
            outer = by_name["outer"][0][S.SPAN_ID]
            full, early = by_name["batches"]
            assert full[S.DUR_MS] >= 300 and full[S.STATUS] == "ok", full
            assert early[S.DUR_MS] >= 100 and early[S.STATUS] == "ok", early  # one item loaded, then closed
            (fail,) = by_name["failing"]
            assert fail[S.STATUS] == "error" and fail[S.ERROR]["type"] == "ValueError", fail
            (agen,) = by_name["abatches"]
            assert agen[S.DUR_MS] >= 300 and agen[S.STATUS] == "ok", agen
            gens = {full[S.SPAN_ID], early[S.SPAN_ID]}
            assert len(by_name["load"]) == 4 and all(r[S.PARENT_SPAN_ID] in gens for r in by_name["load"])
            assert all(r[S.PARENT_SPAN_ID] == agen[S.SPAN_ID] for r in by_name["aload"])
            consumers = by_name["consume"] + by_name["aconsume"]
            assert len(consumers) == 6 and all(r[S.PARENT_SPAN_ID] == outer for r in consumers), consumers
            assert all(r[S.PARENT_SPAN_ID] == outer for r in [full, early, fail, agen])


THREAD_CHILD = textwrap.dedent(
    """
    import sys, threading, time
    import otel_train as ot

    def train():
        ot.init(save_path=sys.argv[1], enabled=True, heartbeat_s=0.2)
        print("ready", flush=True)
        step = 0
        while True:
            with ot.training_step(step), ot.log_trace_span("forward"):
                time.sleep(0.002)
            step += 1

    worker = threading.Thread(target=train, name="ray-train-worker", daemon=sys.argv[2] == "daemon")
    worker.start()
    worker.join()  # the main thread waits in C, as a Ray worker's main loop does
    """
)


def test_sigterm_after_init_off_the_main_thread(tmp_path: Path) -> None:
    import random

    count = trials(6)
    holds = ("init in a non-main thread, main thread blocked in join: SIGTERM at a random moment still ends "
             "the process by SIGTERM with no torn line, seq gapless, every span ended, process_end last with "
             "signal=SIGTERM; summarize says signal SIGTERM and finds no crash")
    rng = random.Random(21)
    with reported("SIGTERM after init() off the main thread (Ray Train workers)", holds, count):
        for trial in range(count):
            run = tmp_path / f"run{trial}"
            child = subprocess.Popen([sys.executable, "-c", THREAD_CHILD, str(run), rng.choice(["daemon", "plain"])],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                assert child.stdout is not None and child.stdout.readline().strip() == "ready"
                time.sleep(rng.uniform(0.05, 0.5))
                child.send_signal(signal.SIGTERM)
                _, err = child.communicate(timeout=30)
            finally:
                if child.poll() is None:
                    child.kill()
            assert child.returncode == -signal.SIGTERM, (child.returncode, err[-2000:])
            (trace,) = traces(run)
            assert_clean_end(trace)
            assert trace.records[-1][S.ATTRS].get("signal") == "SIGTERM", trace.records[-1]
            summary = subprocess.run([sys.executable, "-m", "otel_train.cli", "summarize", str(run), "--json"],
                                     capture_output=True, text=True, timeout=120)
            assert summary.returncode == 0, summary.stderr[-2000:]
            out = json.loads(summary.stdout)
            (row,) = out["processes"]
            assert row["signal"] == "SIGTERM" and row["ended_cleanly"], row
            assert not [f for f in out["findings"] if f["kind"] == "crash"], out["findings"]
