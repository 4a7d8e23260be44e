"""A record is on disk when the call that emitted it returns (docs/runtime.md, "The write guarantee").

Processes SIGKILL themselves at once, with no sleep and no flush before the kill (selfkill.py), and a
C call that holds the GIL runs inside a span: what the calls that returned made must be in the files.
A writer that lets records wait anywhere in Python (a queue, a thread, a buffer) fails these tests:
the child never gives such a writer time to catch up.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from faultlib import assert_gapless, reported, traces

from otel_train import schema as S

DRIVER = Path(__file__).with_name("selfkill.py")


def run_driver(*args: str, timeout: float) -> list[dict]:
    done = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    for result in results:
        assert result["signal"] == signal.SIGKILL, (result, done.stderr[-3000:])
    return results


def random_trials() -> int:
    """100 in ``make test``; ``make faults`` (FAULT_TRIALS=100) runs ten times as many."""
    return max(100, 10 * int(os.environ.get("FAULT_TRIALS", "0") or 0))


def test_sigkill_inside_a_span_at_once_leaves_every_earlier_record_and_the_span_start(tmp_path: Path) -> None:
    holds = ("every record made before the kill and the open forward's start on disk, seq gapless from 1, "
             "the forward start the last record (kill at steps 0, 1, 3, 50, 2000, with and without a rotation "
             "just before)")
    with reported("SIGKILL of itself inside forward, no sleep before it", holds, 10):
        results = run_driver("steps", str(tmp_path), timeout=300)
        assert len(results) == 10
        for result in results:
            (trace,) = traces(Path(result["run"]))
            assert not trace.torn, (result, trace.torn[:2])
            assert_gapless(trace)
            assert trace.seqs[-1] == result["made"], result  # nothing made is missing, nothing after the kill
            last = trace.records[-1]
            assert (last[S.KIND], last[S.NAME], last[S.STEP]) == (S.SPAN_START, "forward", result["kill_at"]), last
            steps = [r for r in trace.records if r[S.NAME] == "step" and r[S.KIND] == S.SPAN_END]
            assert [r[S.STEP] for r in steps] == list(range(result["kill_at"])), result
            if result["rotate"]:
                segments = sorted(Path(result["run"], S.STRUCTURED_LOGS_DIR).iterdir())
                newest = next(p for p in segments if p.name.endswith(S.FILE_SUFFIX))
                assert len(segments) > 1 and newest.read_bytes().count(b"\n") == 2, result


def test_sigkill_at_random_instants_loses_no_earlier_record(tmp_path: Path) -> None:
    count = random_trials()
    holds = ("every record up to the last one a returned call made (told through shared memory, no system call) "
             "on disk; seq gapless; at most the one record being written torn, at the very end")
    seed = random.randrange(1 << 30)
    with reported("SIGKILL of itself from a thread at a random instant (nested spans, scalars, instants, "
                  "rotation)", holds, count):
        results = run_driver("random", str(count), str(tmp_path), str(seed), timeout=60 + count)
        assert len(results) == count
        for result in results:
            (trace,) = traces(Path(result["run"]))
            assert len(trace.torn) <= 1 and (not trace.torn or trace.torn_tail), (seed, result, trace.torn[:2])
            assert_gapless(trace)
            assert trace.seqs[-1] >= result["made"], (seed, result, trace.seqs[-1])  # 0 records lost
        print(f"random self-kills: {count} trials, seed {seed}, "
              f"{sum(r['made'] for r in results)} records made before the kills, none lost")


GIL_CHILD = textwrap.dedent("""
    import mmap, sys
    import otel_train as ot
    page = mmap.mmap(int(sys.argv[2]), mmap.PAGESIZE)
    ot.init(save_path=sys.argv[1], enabled=True, collectives="off")
    with ot.training_step(0):
        with ot.log_trace_span("data_fetch"):
            pass
        with ot.log_trace_span("forward"):
            page[0:1] = b"i"  # a memory store: no system call that would let another thread run
            sum(range(4 * 10**9))  # C code that never lets go of the GIL (minutes)
            page[0:1] = b"o"
""")


def test_a_c_call_holding_the_gil_cannot_keep_its_spans_start_from_the_file(tmp_path: Path) -> None:
    holds = "the forward start in the file while a C call holding the GIL runs inside forward"
    with reported("a C call that holds the GIL inside a span", holds, 1):
        shared = tmp_path / "page"
        shared.write_bytes(b"\0" * mmap.PAGESIZE)
        fd = os.open(shared, os.O_RDWR)
        page = mmap.mmap(fd, mmap.PAGESIZE)
        script = tmp_path / "child.py"
        script.write_text(GIL_CHILD)
        run = tmp_path / "run"
        child = subprocess.Popen([sys.executable, str(script), str(run), str(fd)], pass_fds=(fd,),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            end = time.monotonic() + 60
            while page[0:1] != b"i":
                assert child.poll() is None and time.monotonic() < end, child.stderr.read()[-2000:]
                time.sleep(0.01)
            time.sleep(0.3)  # the parent waits, not the child: the C call runs on, holding the GIL
            (trace,) = traces(run)
            still_inside = page[0:1] == b"i" and child.poll() is None
        finally:
            child.kill()
            child.wait(10)
            page.close()
            os.close(fd)
        assert still_inside, "the C call ended before the file was read: the test saw nothing"
        last = trace.records[-1]
        assert (last[S.KIND], last[S.NAME]) == (S.SPAN_START, "forward"), [r[S.EVENT] for r in trace.records]
        assert_gapless(trace)
