"""A full disk (a real 1 MiB tmpfs, or an injected ENOSPC where mounting is not allowed) and the run
directory deleted and re-created while training writes."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultlib import Trace, assert_gapless, reported, traces, trials

import otel_train as ot
from otel_train import runtime
from otel_train import schema as S
from otel_train.exporters.jsonl import writer as writer_module
from otel_train.exporters.jsonl.writer import CHECK_INTERVAL_S


def train(steps: range, pad: int = 0) -> int:
    done = 0
    for i in steps:
        with ot.training_step(i):
            with ot.log_trace_span("forward", pad="x" * pad):
                ot.log_trace_scalar({"loss": 1.0 / (i + 1)})
            with ot.log_trace_span("backward"):
                ot.log_trace_instant("grad_ready", bucket=i % 4)
        done += 1
    return done


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, object]]:
    """(a directory on a 1 MiB tmpfs, a function that frees space); an injected ENOSPC without root."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                 capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    if mounted:
        mnt.chmod(0o755)  # a tmpfs is mounted 1777: a run directory anyone may write into is refused at init
        ballast = mnt / "ballast"
        ballast.write_bytes(b"\0" * (256 * 1024))
        try:
            yield mnt, ballast.unlink
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)
        return
    # Injected: os.write in the writer fails with ENOSPC after 256 KiB, until space is "freed".
    state = {"left": 256 * 1024, "full": True}

    def write(fd: int, data: bytes) -> int:
        if state["full"] and fd > 2:
            if state["left"] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = min(len(data), state["left"])
            state["left"] -= n
            return os.write(fd, bytes(data[:n]))
        return os.write(fd, data)

    monkeypatch.setattr(writer_module, "os", types.SimpleNamespace(**{**vars(os), "write": write}))
    yield mnt, lambda: state.update(full=False)


def test_full_disk_training_goes_on_every_loss_counted(full_disk: tuple[Path, object],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    mnt, free = full_disk
    holds = ("training never sees an exception; one stderr line per fault; writing resumes when space "
             "comes back; missing seqs = process_end.dropped_records; at most one torn fragment")
    with reported("full disk (1 MiB tmpfs, ENOSPC mid-line)", holds, 1):
        ot.init(save_path=mnt, enabled=True, max_file_size_mb=0.5, backup_count=1)
        assert train(range(600), pad=300) == 600  # ~1 MB into what is left of 1 MiB
        writer = runtime._active.writer
        assert writer.errors > 0
        free()
        assert train(range(600, 610)) == 10
        ot.shutdown()
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("otel-train:")]
        assert len(lines) == 2 and "ENOSPC" in lines[0] and "at shutdown" in lines[1], lines
        (trace,) = traces(mnt)
        assert len(trace.torn) <= 1
        end = trace.records[-1]
        assert end[S.NAME] == S.INSTANT_PROCESS_END
        missing = end[S.SEQ] - len(trace.records) - _rotated_away(trace)
        assert missing == end[S.ATTRS]["dropped_records"] > 0
        assert {r[S.STEP] for r in trace.records if r.get(S.STEP, 0) >= 600} == set(range(600, 610))


def _rotated_away(trace: Trace) -> int:
    # Records before the oldest kept segment are gone by design (backup_count), not dropped.
    return trace.seqs[0] - 1


def test_run_directory_deleted_and_recreated_mid_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    count = trials(3)
    holds = ("training never sees an exception; the deletion is reported once; the new file starts with "
             "an otel_train.write_errors notice; process_end.dropped_records counts every record not on disk")
    rng = random.Random()
    with reported("run directory deleted (rm -rf) mid-run, then re-created", holds, count):
        for trial in range(count):
            run = tmp_path / f"run{trial}"
            ot.init(save_path=run, enabled=True, max_file_size_mb=0.05, backup_count=50)
            writer = runtime._active.writer
            assert train(range(rng.randrange(5, 60))) > 0
            shutil.rmtree(run)
            assert train(range(100, 100 + rng.randrange(1, 40))) > 0  # nowhere to write: counted
            run.mkdir()  # the job makes it again
            time.sleep(rng.uniform(0, 0.3) + CHECK_INTERVAL_S)  # at most a check interval: writing resumes
            assert train(range(200, 260)) == 60
            ot.shutdown()
            err = capsys.readouterr().err
            assert "was deleted" in err, err
            (trace,) = traces(run)
            assert not trace.torn
            assert_gapless(trace, start=None)
            names = [r[S.NAME] for r in trace.records]
            assert S.INSTANT_WRITE_ERRORS in names, names[:10]
            assert names[1] == S.INSTANT_WRITE_ERRORS, names[:10]  # right after the new file's first record
            end = trace.records[-1]
            assert end[S.NAME] == S.INSTANT_PROCESS_END
            assert end[S.ATTRS]["dropped_records"] == writer.dropped_records == trace.seqs[0] - 1
            assert {r[S.STEP] for r in trace.records if r.get(S.STEP, 0) >= 200} == set(range(200, 260))
