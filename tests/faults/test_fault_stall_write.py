"""A trace file whose writes stop returning (issue 19, item 12): a FUSE mount (gcsfuse, s3fs) that stops
answering, an NFS server gone. Reproduced without FUSE by a FIFO: its reader holds it open and never
reads (a write blocks once its 64 KiB buffer is full), or nobody opens it (opening it blocks).

What must hold: training goes on (each step within a bound: the writer is declared stalled after
``STALL_S`` and nothing waits on it after that), what could not be written is counted exactly and
reported (stderr at exit; a notice record once writing resumes), and SIGTERM still ends the process,
dying of SIGTERM, within the shutdown deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from faultlib import reported

from otel_train import schema as S
from otel_train.exporters.jsonl.writer import BATCH_LINES
from otel_train.runtime import SHUTDOWN_FILE_FLOOR_S, SIGTERM_SHUTDOWN_TIMEOUT_S
from otel_train.sigterm import MAX_DEFERRALS, RETRY_S

CHILD = textwrap.dedent(r"""
    import os, sys, time
    import otel_train as ot
    from otel_train import runtime

    run, fifo, progress_path, mode = sys.argv[1:5]
    ot.init(save_path=run, enabled=True, digest_s=0.2)
    progress = os.open(progress_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    step = 0
    while True:
        with ot.training_step(step):
            with ot.log_trace_span("forward", pad="x" * 200):
                ot.log_trace_scalar({"loss": 1.0 / (step + 1)})
            with ot.log_trace_span("backward"):
                ot.log_trace_instant("grad_ready", bucket=step % 4)
        os.write(progress, b"%d %d\n" % (step, time.monotonic_ns()))
        if mode == "pipe" and step == 50:
            # The storage stops answering: from here on the trace file's descriptor is a FIFO whose
            # reader never reads, so a write blocks once its 64 KiB buffer is full.
            w = os.open(fifo, os.O_WRONLY)
            path = runtime.trace_file()
            for name in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{name}")
                except OSError:
                    continue
                if target == path:
                    os.dup2(w, int(name))
            os.close(w)
            os.write(progress, b"stalled %d\n" % time.monotonic_ns())
        step += 1
""")

DEADLINE_S = SIGTERM_SHUTDOWN_TIMEOUT_S + SHUTDOWN_FILE_FLOOR_S + MAX_DEFERRALS * RETRY_S
"""What SIGTERM may take: the shutdown's own bound (its file floor included) plus the handler's
deferrals (docs/runtime.md)."""
STEP_BOUND_S = 2.0
"""No step may take longer than this once the trace file stalls: a liveness bound (the design's is 0.1 s,
measured figures in docs/reliability.md), generous for a loaded 2-core machine."""
TRAIN_PAST_STALL_S = 3.0
"""How long training must go on after the stall began (longer than the 1 s file check and the stall
threshold, long enough to fill the 8 MiB queue in this loop)."""


class Child:
    """The training process and its progress file (one ``step monotonic_ns`` line per step)."""

    def __init__(self, tmp: Path, mode: str, fifo: Path) -> None:
        script = tmp / "child.py"
        script.write_text(CHILD)
        self.run = tmp / "run"
        self.progress = tmp / "progress.txt"
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.run), str(fifo), str(self.progress), mode],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp)
        self.err = b""
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    def steps(self) -> list[tuple[int, int]]:
        if not self.progress.exists():
            return []
        out = []
        for line in self.progress.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                out.append((int(parts[0]), int(parts[1])))
        return out

    def wait_for(self, what: str, predicate, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"the child died while waiting for {what}: {self.stderr()[-2000:]}"
            assert time.monotonic() < end, f"{what}: not within {timeout_s} s; last steps {self.steps()[-3:]}"
            time.sleep(0.02)

    def train_past(self, t0_ns: int, seconds: float) -> None:
        """Wait until a step ends ``seconds`` after ``t0_ns``: training goes on through the stall."""
        goal = t0_ns + int(seconds * 1e9)
        self.wait_for(f"training {seconds} s past the stall",
                      lambda: (s := self.steps()) and s[-1][1] >= goal, seconds + 12)

    def terminate(self) -> float:
        """SIGTERM; how long the process took to die of it."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=DEADLINE_S + 6)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still alive {DEADLINE_S + 6:.0f} s after SIGTERM: {self.stderr()[-2000:]}")
        took = time.monotonic() - t0
        self._err_reader.join(5)
        assert rc == -signal.SIGTERM, (rc, self.stderr()[-3000:])
        return took

    def stderr(self) -> str:
        return self.err.decode("utf-8", "replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def records(data: bytes, torn_tail_ok: bool = False) -> list[dict]:
    """Every line parsed (a torn one fails the test), but for a tail cut by a write that never returned."""
    lines = data.split(b"\n")
    tail = lines.pop()
    assert torn_tail_ok or not tail, tail[:200]
    return [json.loads(line) for line in lines if line]


def max_gap_after(steps: list[tuple[int, int]], t0_ns: int) -> float:
    times = [t for _, t in steps if t >= t0_ns]
    return max((b - a for a, b in zip(times, times[1:])), default=0) / 1e9


def summary_counts(err: str) -> tuple[int, int]:
    """(records not in the trace file, records made) from the shutdown line."""
    match = re.search(r"at shutdown: (\d+) record\(s\) of this process are not in its trace file "
                      r"\(process_end\.dropped_records; (\d+) made\)", err)
    assert match, err[-3000:]
    return int(match[1]), int(match[2])


def test_a_blocked_write_never_stops_training_and_sigterm_still_ends_it(tmp_path: Path) -> None:
    holds = ("training goes on (every step within 2 s, design: one wait of 0.1 s) while every write to the trace "
             "file blocks; SIGTERM ends the process (dies of SIGTERM) within the shutdown deadline; every record "
             "made is in the file or the FIFO or counted as not written (stderr), the write that never returned "
             "counted whole")
    with reported("trace file writes block forever (a FIFO nobody reads), then SIGTERM", holds, 1):
        fifo = tmp_path / "stalled.fifo"
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read: writes block
        child = Child(tmp_path, "pipe", fifo)
        try:
            child.wait_for("the stall", lambda: b"stalled" in child.progress.read_bytes()
                           if child.progress.exists() else False, 60)
            stalled_at = int(child.progress.read_text().split("stalled ")[1].split()[0])
            child.train_past(stalled_at, TRAIN_PAST_STALL_S)
            took = child.terminate()
        finally:
            child.kill()
        steps_after = [s for s, t in child.steps() if t >= stalled_at]
        gap = max_gap_after(child.steps(), stalled_at)
        err = child.stderr()
        assert len(steps_after) >= 100 and gap <= STEP_BOUND_S, (len(steps_after), gap)
        assert took <= DEADLINE_S + 6
        assert "has stalled" in err, err[-3000:]
        in_fifo = b""
        while True:
            try:
                chunk = os.read(reader, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            in_fifo += chunk
        os.close(reader)
        (trace_file,) = (child.run / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}")
        # The write that never returns may have put part of its batch into the FIFO (a torn tail).
        on_disk, in_pipe = records(trace_file.read_bytes()), records(in_fifo, torn_tail_ok=True)
        seqs = [r[S.SEQ] for r in on_disk + in_pipe]
        assert seqs == list(range(1, len(seqs) + 1))  # what reached the kernel is whole and in order
        assert in_pipe, "the FIFO took nothing: the stall was not where the test put it"
        not_written, made = summary_counts(err)
        # Every record made is in the file or the FIFO, or counted; the batch of the write in progress is
        # counted as not written although some of it may have reached the FIFO.
        written = made - not_written
        assert not_written > 0 and written <= len(seqs) <= written + BATCH_LINES, (made, len(seqs), not_written)
        assert made >= 6 * len(steps_after)  # the records of every step trained through the stall were made
        print(f"stall: {len(steps_after)} steps in {TRAIN_PAST_STALL_S} s, max step gap {gap * 1e3:.1f} ms, "
              f"SIGTERM took {took:.2f} s, {not_written} of {made} records not written")


def test_a_stall_that_resumes_reports_what_it_dropped(tmp_path: Path) -> None:
    holds = ("the trace file replaced by a FIFO nobody opens: training goes on (every step within 2 s); once a "
             "reader comes, writing resumes with a notice counting the dropped records and the deletion's lost "
             "ones; process_end.dropped_records = every record not written; SIGTERM ends the process")
    with reported("trace file replaced by a FIFO opened only later (a stall that resumes)", holds, 1):
        fifo = tmp_path / "unused.fifo"
        child = Child(tmp_path, "fifo", fifo)
        stream = bytearray()
        reader: threading.Thread | None = None
        try:
            child.wait_for("50 steps", lambda: len(child.steps()) > 50, 60)
            (trace_file,) = (child.run / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}")
            old = os.open(trace_file, os.O_RDONLY)  # what the deleted file holds stays readable here
            os.unlink(trace_file)
            os.mkfifo(trace_file, 0o644)  # the writer's periodic check re-makes the file: opening it blocks
            stalled_at = time.monotonic_ns()
            child.train_past(stalled_at, TRAIN_PAST_STALL_S)

            def read_fifo() -> None:
                fd = os.open(trace_file, os.O_RDONLY)  # the blocked open on the other side returns
                while chunk := os.read(fd, 1 << 16):
                    stream.extend(chunk)
                os.close(fd)

            reader = threading.Thread(target=read_fifo, daemon=True)
            reader.start()
            child.wait_for("the stall notice", lambda: b"trace file write stalled" in stream, 20)
            resumed_at = time.monotonic_ns()
            child.train_past(resumed_at, 0.2)
            took = child.terminate()
            reader.join(10)
        finally:
            child.kill()
        gap = max_gap_after(child.steps(), stalled_at)
        assert gap <= STEP_BOUND_S, gap
        err = child.stderr()
        assert "has stalled" in err and "resumed" in err, err[-3000:]
        before = records(os.pread(old, 1 << 30, 0))
        os.close(old)
        after = records(bytes(stream))
        assert [r[S.SEQ] for r in before] == list(range(1, len(before) + 1))
        notices = [r for r in after if r[S.NAME] == S.INSTANT_WRITE_ERRORS]
        stall = next(r[S.ATTRS] for r in notices if r[S.ATTRS].get("reason") == "trace file write stalled")
        deleted = next(r[S.ATTRS] for r in notices if r[S.ATTRS].get("reason") == "trace file deleted")
        assert deleted["lost_records"] == len(before)  # the records written to the file that was replaced
        end = after[-1]
        assert end[S.NAME] == S.INSTANT_PROCESS_END and end[S.ATTRS]["signal"] == "SIGTERM"
        seqs = [r[S.SEQ] for r in after]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        missing = end[S.SEQ] - len(after)  # every seq not in the FIFO's stream
        assert end[S.ATTRS]["dropped_records"] == missing == len(before) + stall["dropped_records"]
        assert stall["dropped_records"] > 0 and stall["stalled_ms"] >= 100
        gaps = sum(b - a - 1 for a, b in zip(seqs, seqs[1:]))
        assert gaps == stall["dropped_records"]  # the drops are exactly the seqs missing after the deletion
        print(f"resume: stalled {stall['stalled_ms']:.0f} ms, {stall['dropped_records']} records dropped, "
              f"max step gap {gap * 1e3:.1f} ms, SIGTERM took {took:.2f} s")
