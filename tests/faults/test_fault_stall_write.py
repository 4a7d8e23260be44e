"""A trace file whose writes stop returning: a FUSE mount (gcsfuse, s3fs) that stops answering, an NFS
server gone. Reproduced without FUSE by a FIFO: its reader holds it open and never reads (a write blocks
once the pipe's buffer is full), or nobody opens it (opening it blocks).

What must hold (docs/runtime.md, "A trace file that stops answering"): every record is written in the
thread that made it, so the thread whose write does not return waits for the storage (crash safety wins
that trade); a thread of the library (the ticker, not the stalled one) detects the stall within
``STALL_S`` + ``TICK_S`` and reports it once on stderr; records that other threads make meanwhile are
dropped and counted at once, never queued and never waited for; when the storage answers, a notice
record says how long it stalled and how many records were dropped; ``process_end.dropped_records``
counts every record that is not in the file; and SIGTERM still ends the process, dying of SIGTERM,
within the shutdown deadline.
"""

from __future__ import annotations

import fcntl
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
from otel_train.exporters.jsonl.writer import STALL_S, TICK_S
from otel_train.runtime import SHUTDOWN_FILE_FLOOR_S, SIGTERM_SHUTDOWN_TIMEOUT_S
from otel_train.sigterm import MAX_DEFERRALS, RETRY_S

CHILD = textwrap.dedent(r"""
    import os, sys, threading, time
    import otel_train as ot
    from otel_train import runtime

    run, fifo, progress_path, loader_path, mode = sys.argv[1:6]
    ot.init(save_path=run, enabled=True, digest_s=0.2, collectives="off")
    progress = os.open(progress_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    loader = os.open(loader_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def load():  # a data-loading thread: an instant every 2 ms, and a line of its own progress
        i = 0
        while True:
            ot.log_trace_instant("batch_ready", i=i)
            os.write(loader, b"%d %d\n" % (i, time.monotonic_ns()))
            i += 1
            time.sleep(0.002)

    threading.Thread(target=load, daemon=True).start()
    step = 0
    while True:
        with ot.training_step(step):
            with ot.log_trace_span("forward", pad="x" * 200):
                ot.log_trace_scalar({"loss": 1.0 / (step + 1)})
        os.write(progress, b"%d %d\n" % (step, time.monotonic_ns()))
        if mode == "pipe" and step == 50:
            # The storage stops answering: from here on the trace file's descriptor is a FIFO whose
            # reader never reads, so a write blocks once its buffer (one page) is full.
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
REPORT_BOUND_S = 2.0
"""The stall must be on stderr this soon after the training thread's last step: a liveness bound for a
loaded 2-core machine (the design: ``STALL_S`` + ``TICK_S`` = 0.6 s; measured figures in docs/runtime.md)."""
LOADER_GAP_S = 2.0
"""The loader thread never waits this long for a record while the training thread is stuck (design:
it waits until the stall is found, ``STALL_S`` + ``TICK_S``, once)."""


def lines_of(path: Path) -> list[tuple[int, int]]:
    """``(n, monotonic_ns)`` lines of a progress file."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), int(parts[1])))
    return out


class Child:
    """The training process, its progress files, and its stderr lines stamped as they arrive."""

    def __init__(self, tmp: Path, mode: str, fifo: Path, run: Path | None = None) -> None:
        script = tmp / "child.py"
        script.write_text(CHILD)
        self.run = run or tmp / "run"
        self.progress, self.loader = tmp / "progress.txt", tmp / "loader.txt"
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.run), str(fifo), str(self.progress),
                                      str(self.loader), mode], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err: list[tuple[int, str]] = []  # (monotonic_ns when read, line)
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append((time.monotonic_ns(), line.decode("utf-8", "replace")))

    def steps(self) -> list[tuple[int, int]]:
        return lines_of(self.progress)

    def stalled_at(self) -> int:
        return int(self.progress.read_text().split("stalled ")[1].split()[0])

    def wait_for(self, what: str, predicate, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"the child died while waiting for {what}: {self.stderr()[-2000:]}"
            assert time.monotonic() < end, f"{what}: not within {timeout_s} s; last steps {self.steps()[-3:]}"
            time.sleep(0.02)

    def said(self, text: str) -> int | None:
        """When a stderr line holding ``text`` arrived (monotonic ns), or None."""
        return next((t for t, line in self.err if text in line), None)

    def terminate(self) -> float:
        """SIGTERM; how long the process took to die of it."""
        t0 = time.monotonic()
        self.sigterm_at = time.monotonic_ns()
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
        return "".join(line for _, line in self.err)

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


def summary_counts(err: str) -> tuple[int, int]:
    """(records not in the trace file, records made) from the shutdown line."""
    match = re.search(r"at shutdown: (\d+) record\(s\) of this process are not in its trace file "
                      r"\(process_end\.dropped_records; (\d+) made\)", err)
    assert match, err[-3000:]
    return int(match[1]), int(match[2])


def max_gap(points: list[tuple[int, int]], after_ns: int) -> float:
    times = [t for _, t in points if t >= after_ns]
    return max((b - a for a, b in zip(times, times[1:])), default=0) / 1e9


def test_a_write_that_never_returns_is_reported_other_threads_drop_and_sigterm_ends_it(tmp_path: Path) -> None:
    holds = ("the training thread waits in its write; the stall is on stderr within 2 s of its last step "
             "(design 0.6 s); the loader thread never waits 2 s for a record, its records dropped and counted; "
             "SIGTERM ends the process (dies of SIGTERM) within the shutdown deadline; every record made is in "
             "the file or the FIFO or counted as not written")
    with reported("trace file writes block forever (a FIFO nobody reads), then SIGTERM", holds, 1):
        fifo = tmp_path / "stalled.fifo"
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read: writes block
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
        child = Child(tmp_path, "pipe", fifo)
        try:
            child.wait_for("the stall", lambda: child.progress.exists() and b"stalled" in child.progress.read_bytes(), 60)
            child.wait_for("the stall's report", lambda: child.said("has stalled") is not None, 20)
            reported_at = child.said("has stalled")
            time.sleep(1.0)  # the parent waits: the loader thread goes on making records meanwhile
            took = child.terminate()
        finally:
            child.kill()
        last_step = child.steps()[-1][1]
        latency = (reported_at - last_step) / 1e9
        assert latency <= REPORT_BOUND_S, latency
        assert child.stderr().count("has stalled") == 1
        loads = lines_of(child.loader)
        after = [n for n, t in loads if reported_at < t < child.sigterm_at]  # records made, none written
        assert len(after) >= 20 and max_gap(loads, child.stalled_at()) <= LOADER_GAP_S, (len(after), loads[-3:])
        assert took <= DEADLINE_S + 6
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
        # The write that never returned may have put part of its record into the FIFO (a torn tail).
        on_disk, in_pipe = records(trace_file.read_bytes()), records(in_fifo, torn_tail_ok=True)
        seqs = [r[S.SEQ] for r in on_disk + in_pipe]
        assert seqs == list(range(1, len(seqs) + 1))  # what reached the kernel is whole and in order
        assert in_pipe, "the FIFO took nothing: the stall was not where the test put it"
        not_written, made = summary_counts(child.stderr())
        # Made: every seq given out, the one stuck in its write included; not written: the records the
        # loader made while the lock was held by the stuck write (no seq), and what shutdown could not end.
        assert made == seqs[-1] + 1 or made == seqs[-1], (made, seqs[-1])
        assert not_written >= len(after) - 1, (not_written, len(after))
        print(f"stall: reported {latency * 1e3:.0f} ms after the last step, SIGTERM took {took:.2f} s, "
              f"{not_written} records not written, the loader went on ({len(after)} batches after the report)")


def test_a_stall_that_resumes_reports_what_it_dropped(tmp_path: Path) -> None:
    holds = ("the trace file replaced by a FIFO nobody opens: the stall is reported; once a reader comes, writing "
             "resumes with a notice counting the records dropped meanwhile and the deletion's lost ones; "
             "process_end.dropped_records = every record not written; SIGTERM ends the process")
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
            child.wait_for("the stall's report", lambda: child.said("has stalled") is not None, 20)
            time.sleep(0.5)  # the loader goes on meanwhile: its records are dropped

            def read_fifo() -> None:
                fd = os.open(trace_file, os.O_RDONLY)  # the blocked open on the other side returns
                while chunk := os.read(fd, 1 << 16):
                    stream.extend(chunk)
                os.close(fd)

            reader = threading.Thread(target=read_fifo, daemon=True)
            reader.start()
            child.wait_for("the stall notice", lambda: b"trace file write stalled" in stream, 20)
            resumed_at = time.monotonic_ns()
            child.wait_for("steps after the resume", lambda: child.steps()[-1][1] > resumed_at + 2e8, 20)
            took = child.terminate()
            reader.join(10)
        finally:
            child.kill()
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
        assert seqs == list(range(len(before) + 1, len(before) + 1 + len(seqs)))  # gapless: drops get no seq
        assert stall["dropped_records"] > 0 and stall["stalled_ms"] >= (STALL_S - TICK_S) * 1e3
        assert end[S.ATTRS]["dropped_records"] == len(before) + stall["dropped_records"]
        print(f"resume: stalled {stall['stalled_ms']:.0f} ms, {stall['dropped_records']} records dropped, "
              f"SIGTERM took {took:.2f} s")


STALLFS = Path(__file__).with_name("stallfs.py")


def _mount(tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A stalling FUSE mount (stallfs.py), or a skip saying why there can be none here."""
    try:
        import fuse  # noqa: F401 - fusepy, with Debian's libfuse2 (make test installs both)
    except (ImportError, OSError, EnvironmentError) as exc:
        import pytest

        pytest.skip(f"no FUSE here ({exc}): make test installs fusepy and Debian's libfuse2")
    mnt, flag = tmp / "mnt", tmp / "stall.flag"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, str(STALLFS), str(mnt), str(flag)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    end = time.monotonic() + 20
    while not os.path.ismount(mnt):
        if daemon.poll() is not None or time.monotonic() > end:
            import pytest

            daemon.kill()
            pytest.skip(f"FUSE mount refused here: {daemon.stderr.read().decode(errors='replace')[-300:]}")
        time.sleep(0.05)
    return daemon, mnt, flag


def _unmount(daemon: subprocess.Popen, mnt: Path, flag: Path) -> None:
    flag.unlink(missing_ok=True)  # the daemon answers again: nothing stays stuck in the kernel
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
    daemon.terminate()
    try:
        daemon.wait(10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait(10)


def test_a_hung_fuse_daemon_is_reported_other_threads_drop_and_the_stall_is_announced(tmp_path: Path) -> None:
    holds = ("a real FUSE mount whose daemon stops answering writes: the stall on stderr within 2 s of the last step; "
             "the loader thread goes on, its records dropped and counted; once the daemon answers, a notice with "
             "their count, training resumes, SIGTERM ends the process and process_end counts every record not written")
    with reported("trace file on a FUSE mount whose daemon hangs (a hung gcsfuse), then answers", holds, 1):
        daemon, mnt, flag = _mount(tmp_path)
        try:
            child = Child(tmp_path, "plain", tmp_path / "unused", run=mnt / "run")
            try:
                child.wait_for("50 steps", lambda: len(child.steps()) > 50, 60)
                flag.touch()  # the daemon hangs
                child.wait_for("the stall's report", lambda: child.said("has stalled") is not None, 20)
                reported_at = child.said("has stalled")
                time.sleep(0.5)
                flag.unlink()  # the daemon answers again
                resumed_at = time.monotonic_ns()
                child.wait_for("steps after the resume", lambda: child.steps()[-1][1] > resumed_at + 3e8, 20)
                took = child.terminate()
            finally:
                child.kill()
            stuck = [t for _, t in child.steps() if t < reported_at][-1]
            latency = (reported_at - stuck) / 1e9
            loads = [n for n, t in lines_of(child.loader) if reported_at < t < resumed_at]
            trace = records(next((mnt / "run" / S.STRUCTURED_LOGS_DIR).glob(f"*{S.FILE_SUFFIX}")).read_bytes())
        finally:
            _unmount(daemon, mnt, flag)
        assert latency <= REPORT_BOUND_S, latency
        assert len(loads) >= 20, loads  # the loader went on while the training thread was stuck
        seqs = [r[S.SEQ] for r in trace]
        assert seqs == list(range(1, len(seqs) + 1))
        (notice,) = [r[S.ATTRS] for r in trace if r.get(S.ATTRS, {}).get("reason") == "trace file write stalled"]
        assert notice["dropped_records"] >= len(loads) - 1 and notice["stalled_ms"] >= 400
        end = trace[-1]
        assert end[S.NAME] == S.INSTANT_PROCESS_END and end[S.ATTRS]["signal"] == "SIGTERM"
        assert end[S.ATTRS]["dropped_records"] == notice["dropped_records"]
        print(f"FUSE: reported {latency * 1e3:.0f} ms after the last step, {notice['dropped_records']} records of "
              f"other threads dropped, stalled {notice['stalled_ms']:.0f} ms, SIGTERM took {took:.2f} s")

