"""Processes that SIGKILL themselves, at once, with no sleep and no flush before the kill.

``python selfkill.py steps OUT_DIR`` and ``python selfkill.py random TRIALS OUT_DIR SEED``: one clean
process (otel_train imported once, no threads) forks a child per case; the child traces into a run
directory of its own and kills itself. Before every API call the child stores, in a page of memory it
shares with the driver (no system call, so nothing the writer could catch up in), the ``seq`` of the last
record made by a call that returned. The driver reads the page once the child is dead: every record up
to that seq must be on disk. One JSON line per case on stdout; the test reads the files.

- ``steps``: at steps 0, 1, 3, 50 and 2,000 the child opens ``forward`` and kills itself inside it, with
  and without a rotation just before (the ``forward`` start is then the second record of a new segment).
- ``random``: a thread of the child kills it after a random 0 – 20 ms while the main thread runs a fast
  loop of nested spans, scalars and instants, on small segments (rotations).
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import otel_train as ot
from otel_train import runtime

STEPS = (0, 1, 3, 50, 2000)
SEGMENT_MB = 0.004  # 4 KB segments in the random trials: a rotation every ~15 records
STEP_SEGMENT_MB = 0.05  # 50 KB segments where a rotation comes just before the kill
BACKUP_COUNT = 10_000  # keep every segment, so seq is checked from 1


def _seq() -> int:
    return runtime._active.jsonl.records_written  # type: ignore[union-attr]


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def step_child(run: Path, kill_at: int, rotate: bool, page: mmap.mmap) -> None:
    ot.init(save_path=str(run), enabled=True, watchdog=False, collectives="off",
            max_file_size_mb=STEP_SEGMENT_MB if rotate else 64, backup_count=BACKUP_COUNT)
    span = ot.log_trace_span
    for step in range(kill_at + 1):
        with ot.training_step(step):
            if step == kill_at and rotate:
                _rotate_now(page)
            with span("forward", micro=step % 3):
                page[:8] = _seq().to_bytes(8, "little")
                if step == kill_at:
                    _kill()
                ot.log_trace_scalar({"loss": 1.0 / (step + 1)})
            page[:8] = _seq().to_bytes(8, "little")
        page[:8] = _seq().to_bytes(8, "little")


def _rotate_now(page: mmap.mmap) -> None:
    """Instants until one of them began a new segment: the active file then holds that one record."""
    path = runtime.trace_file()
    while True:
        before = os.stat(path).st_size
        ot.log_trace_instant("filler", pad="x" * 64)
        page[:8] = _seq().to_bytes(8, "little")
        if os.stat(path).st_size < before:
            return


def random_child(run: Path, delay_s: float, page: mmap.mmap) -> None:
    ot.init(save_path=str(run), enabled=True, watchdog=False, collectives="off",
            max_file_size_mb=SEGMENT_MB, backup_count=BACKUP_COUNT)
    threading.Thread(target=lambda: (time.sleep(delay_s), _kill()), daemon=True).start()
    span, scalar, instant, mark = ot.log_trace_span, ot.log_trace_scalar, ot.log_trace_instant, page.__setitem__
    whole = slice(0, 8)
    step = 0
    while True:
        with ot.training_step(step):
            mark(whole, _seq().to_bytes(8, "little"))
            with span("forward", micro=step % 4):
                mark(whole, _seq().to_bytes(8, "little"))
                with span("attention", layer=step % 2):
                    mark(whole, _seq().to_bytes(8, "little"))
                    scalar({"loss": 1.0 / (step + 1), "ok": True})
                    mark(whole, _seq().to_bytes(8, "little"))
                mark(whole, _seq().to_bytes(8, "little"))
                instant("grad_ready", bucket=step % 8)
                mark(whole, _seq().to_bytes(8, "little"))
            mark(whole, _seq().to_bytes(8, "little"))
        mark(whole, _seq().to_bytes(8, "little"))
        step += 1


def fork_case(out: Path, name: str, child, *args) -> dict:
    run = out / name
    page = mmap.mmap(-1, mmap.PAGESIZE)  # shared with the child (MAP_SHARED, anonymous)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child(run, *args, page)
        except BaseException:  # noqa: BLE001 - a child that did not die of its kill: the driver says so
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    made = int.from_bytes(page[:8], "little")
    page.close()
    return {"run": str(run), "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, "made": made}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[-1] if sys.argv[1] == "steps" else sys.argv[3])
    if mode == "steps":
        for kill_at in STEPS:
            for rotate in (False, True):
                result = fork_case(out, f"step{kill_at}-{'rot' if rotate else 'flat'}", step_child, kill_at, rotate)
                print(json.dumps({**result, "kill_at": kill_at, "rotate": rotate}), flush=True)
        return
    trials, seed = int(sys.argv[2]), int(sys.argv[4])
    rng = random.Random(seed)
    for i in range(trials):
        delay = rng.uniform(0.0, 0.02)
        result = fork_case(out, f"trial{i}", random_child, delay)
        print(json.dumps({**result, "delay_s": delay}), flush=True)


if __name__ == "__main__":
    main()
