"""SIGKILL and SIGTERM at random moments, with threads and rotation (killdriver.py forks the victims)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

from faultlib import assert_clean_end, assert_gapless, reported, segments, traces, trials, unpaired

from otel_train import schema as S

DRIVER = Path(__file__).with_name("killdriver.py")
MAX_BYTES = int(0.02 * 1024 * 1024)


def run_driver(sig: str, count: int, out: Path) -> list[dict]:
    seed = random.randrange(1 << 30)
    done = subprocess.run([sys.executable, str(DRIVER), sig, str(count), str(out), str(seed)],
                          capture_output=True, text=True, timeout=60 + 5 * count)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == count, done.stderr[-3000:]
    for result in results:
        assert result["ready"] and not result["hung"], (result, done.stderr[-3000:])
    return results


def test_sigkill_at_random_moments_loses_nothing_written(tmp_path: Path) -> None:
    count = trials(30)
    holds = ("every line whole but at most the last one; seq gapless from 1 across rotated segments; "
             "every record up to the last one the main thread's returned calls made on disk; "
             "every span end has its start; each segment within max size + one record")
    with reported("SIGKILL at a random moment (3 threads + main, rotation, lean and SDK paths)", holds, count):
        rotated = 0
        for result in run_driver("SIGKILL", count, tmp_path):
            assert result["signal"] == signal.SIGKILL, result
            (paths,) = segments(Path(result["run"])).values()
            rotated += len(paths) > 1
            (trace,) = traces(Path(result["run"]))
            # A kill can tear the one record being written, and only at the very end.
            assert len(trace.torn) <= 1 and (not trace.torn or trace.torn_tail), (result, trace.torn[:2])
            assert_gapless(trace)
            assert trace.seqs[-1] >= result["made"], result  # no lost tail: what returned is on disk
            _, orphan_ends = unpaired(trace)
            assert not orphan_ends, result
            longest = max(len(json.dumps(r)) for r in trace.records) + 200
            assert all(size <= MAX_BYTES + longest for size in trace.sizes), (result, trace.sizes)
        assert rotated >= count // 2  # the trials really exercised rotation


def test_sigterm_at_random_moments_writes_every_record_whole_and_ends_every_span(tmp_path: Path) -> None:
    count = trials(20)
    holds = ("dies of SIGTERM; no torn line; seq gapless 1..N; every thread's open spans end (incomplete) "
             "before process_end, which is last and counts every record")
    with reported("SIGTERM at a random moment (3 threads + main + watchdog, rotation)", holds, count):
        incomplete = 0
        for result in run_driver("SIGTERM", count, tmp_path):
            assert result["signal"] == signal.SIGTERM, result
            (trace,) = traces(Path(result["run"]))
            try:
                assert_clean_end(trace)
            except AssertionError as exc:
                raise AssertionError(f"{result}: {exc}") from None
            incomplete += sum(1 for r in trace.records if r.get(S.STATUS) == S.STATUS_INCOMPLETE)
        assert incomplete >= count  # every trial had spans open on several threads when it was killed
