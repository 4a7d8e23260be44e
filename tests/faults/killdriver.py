"""Kill traced processes at random moments: ``python killdriver.py SIGNAL TRIALS OUT_DIR SEED``.

One clean process (no threads, otel_train imported once) forks a child per trial. The child traces
from four threads (spans with attributes, instants, scalars, step changes) into a run directory of
its own with rotation on; once its first records are on disk it says so through a pipe, and the
driver sends ``SIGNAL`` after a random delay (0 to 200 ms). Odd trials run through the OTel SDK
(a custom exporter handler), even ones through the lean JSONL path. One JSON line per trial on
stdout: the run directory, the delay, how the child ended. The test reads the files.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import select
import signal
import sys
import threading
import time
from pathlib import Path

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

import otel_train as ot
import otel_train.lifecycle
import otel_train.runtime  # noqa: F401 - imported once here, not in every forked child

MAX_FILE_SIZE_MB = 0.02  # 20 KB segments: a trial rotates several times
BACKUP_COUNT = 1000  # keep every segment, so seq is checked from 1
THREADS = 3


class NullExporter(SpanExporter):
    """Takes every span (the SDK path, without a network)."""

    def export(self, spans: object) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def null_exporter() -> NullExporter:
    return NullExporter()


def _emit(label: str, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        with ot.log_trace_span("work", thread=label, i=i):
            with ot.log_trace_span("inner", i=i):
                ot.log_trace_instant("tick", thread=label, i=i)
            if i % 7 == 0:
                ot.log_trace_scalar({"loss": 1.0 / (i + 1), "i": i})
        i += 1


def child(run: Path, ready_fd: int, sdk: bool, page: mmap.mmap) -> None:
    os.chdir(run)  # process_start's git probe finds no repository here, quickly
    handlers = ["killdriver:null_exporter"] if sdk else []
    ot.init(save_path=run, enabled=True, max_file_size_mb=MAX_FILE_SIZE_MB, backup_count=BACKUP_COUNT,
            handlers=handlers, heartbeat_s=0.05, stall_min_s=0.05, stall_factor=1)
    stop = threading.Event()
    for t in range(THREADS):
        threading.Thread(target=_emit, args=(f"t{t}", stop), name=f"emit-{t}", daemon=True).start()
    made = otel_train.runtime._active.jsonl  # the seq of the last record made (records_written)
    step = 0
    while True:
        with ot.training_step(step):
            page[:8] = made.records_written.to_bytes(8, "little")  # a memory store, no system call
            with ot.log_trace_span("forward"):
                page[:8] = made.records_written.to_bytes(8, "little")
                ot.add_step_tag("even" if step % 2 == 0 else "odd")
            page[:8] = made.records_written.to_bytes(8, "little")
            if step == 3:
                os.write(ready_fd, b"r")
        page[:8] = made.records_written.to_bytes(8, "little")
        step += 1


def trial(sig: int, run: Path, rng: random.Random, sdk: bool) -> dict[str, object]:
    run.mkdir(parents=True)
    read_fd, write_fd = os.pipe()
    page = mmap.mmap(-1, mmap.PAGESIZE)  # shared with the child: the seq every returned call's record is within
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_fd)
            child(run, write_fd, sdk, page)
        except BaseException:  # noqa: BLE001 - report and leave; never return into the driver's loop
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(write_fd)
    ready, _, _ = select.select([read_fd], [], [], 30.0)
    os.close(read_fd)
    delay = rng.uniform(0.0, 0.2)
    if ready:
        time.sleep(delay)
    os.kill(pid, sig)
    deadline = time.monotonic() + 15.0
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        status = None  # the last look said "still running" (0): hung, whatever it then dies of
        os.kill(pid, signal.SIGKILL)  # the test fails on "hung"
        os.waitpid(pid, 0)
    made = int.from_bytes(page[:8], "little")
    page.close()
    return {
        "run": str(run), "sdk": sdk, "ready": bool(ready), "delay": round(delay, 3), "made": made,
        "hung": status is None,
        "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
        "exit": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
    }


def main() -> None:
    name, count, out, seed = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    sig = getattr(signal, name)
    rng = random.Random(seed)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for the handler factory
    for i in range(count):
        print(json.dumps(trial(sig, out / f"trial{i:03d}", rng, sdk=i % 2 == 1)), flush=True)


if __name__ == "__main__":
    main()
