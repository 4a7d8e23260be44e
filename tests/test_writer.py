"""RotatingFileWriter against real files, real syscalls, a real tmpfs and a real SIGKILL."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from otel_train.exporters.jsonl.writer import QueuedWriter, RotatingFileWriter

WARNING = "otel-train: cannot write"


def record(seq: int, pad: int = 0) -> bytes:
    return json.dumps({"seq": seq, "pad": "x" * pad}).encode() + b"\n"


def seqs(data: bytes) -> list[int]:
    return [json.loads(line)["seq"] for line in data.splitlines()]


def segments(path: Path) -> list[Path]:
    """Existing segments, oldest first (path.N … path.1, path)."""
    rotated = sorted(path.parent.glob(path.name + ".*"), key=lambda p: int(p.suffix[1:]))
    return [*reversed(rotated), path]


def test_lines_land_complete_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=2)
    assert all(w.write(record(i, pad=i % 7)) for i in range(200))
    assert seqs(path.read_bytes()) == list(range(200))
    assert (w.errors, w.dropped_bytes, w.path) == (0, 0, str(path))
    assert not list(tmp_path.glob("t.jsonl.*"))  # no rotation
    w.close()


def test_append_to_existing_file_counts_its_size(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    old = record(0, pad=80)
    path.write_bytes(old)
    w = RotatingFileWriter(path, max_bytes=len(old) + 10, backup_count=1)
    assert w.write(record(1, pad=20))  # would exceed max_bytes only if the old bytes count
    assert Path(f"{path}.1").read_bytes() == old
    assert seqs(path.read_bytes()) == [1]
    w.close()


def test_torn_tail_left_by_an_earlier_process_is_isolated(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(record(0) + record(1)[:5])
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=1)
    assert w.write(record(2))
    w.close()
    assert path.read_bytes().split(b"\n") == [record(0)[:-1], record(1)[:5], record(2)[:-1], b""]


def test_rotation_bounds_disk_and_keeps_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    max_bytes, backups, total = 2000, 3, 1500
    w = RotatingFileWriter(path, max_bytes=max_bytes, backup_count=backups)
    longest = 0
    for i in range(total):
        line = record(i, pad=(i * 37) % 90)
        longest = max(longest, len(line))
        assert w.write(line)
    w.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted([path.name] + [f"{path.name}.{i}" for i in range(1, backups + 1)])
    sizes = [p.stat().st_size for p in segments(path)]
    assert all(s <= max_bytes for s in sizes)
    assert sum(sizes) <= (backups + 1) * max_bytes + longest
    kept = [s for p in segments(path) for s in seqs(p.read_bytes())]
    assert kept == list(range(kept[0], total))  # oldest in path.N, newest last in path
    assert w.errors == 0


def test_backup_count_zero_truncates(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=500, backup_count=0)
    for i in range(300):
        assert w.write(record(i, pad=i % 30))
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert path.stat().st_size <= 500
    kept = seqs(path.read_bytes())
    assert kept == list(range(kept[0], 300)) and kept[0] > 0  # truncated in place


def test_line_longer_than_max_bytes_is_written_alone(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=10, backup_count=5)
    for i in range(8):
        assert w.write(record(i, pad=30))
    w.close()
    assert [seqs(p.read_bytes()) for p in segments(path)] == [[i] for i in range(2, 8)]


def test_mode_and_cloexec(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # prove the writer asks for 0o644, not that the umask hides a 0o666
    try:
        path = tmp_path / "t.jsonl"
        w = RotatingFileWriter(path, max_bytes=50, backup_count=1)
        w.write(record(0, pad=40))
        w.write(record(1, pad=40))  # rotates: the fresh file gets the same mode
    finally:
        os.umask(old_umask)
    for p in (path, Path(f"{path}.1")):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert fcntl.fcntl(w._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    w.close()
    w2 = RotatingFileWriter(tmp_path / "private.jsonl", max_bytes=50, backup_count=0, file_mode=0o600)
    assert stat.S_IMODE((tmp_path / "private.jsonl").stat().st_mode) == 0o600
    w2.close()


def test_close_is_idempotent_and_later_writes_drop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = RotatingFileWriter(tmp_path / "t.jsonl", max_bytes=100, backup_count=0, fsync=True)
    assert w.write(record(0))
    w.close()
    w.close()
    line = record(1)
    assert w.write(line) is False
    assert w.dropped_bytes == len(line) and w.errors == 0
    assert seqs((tmp_path / "t.jsonl").read_bytes()) == [0]
    assert capsys.readouterr().err == ""


def test_bad_arguments_and_missing_directory_raise_at_init(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        RotatingFileWriter(tmp_path / "t.jsonl", max_bytes=0, backup_count=1)
    with pytest.raises(ValueError, match="backup_count"):
        RotatingFileWriter(tmp_path / "t.jsonl", max_bytes=10, backup_count=-1)
    with pytest.raises(FileNotFoundError):
        RotatingFileWriter(tmp_path / "missing" / "t.jsonl", max_bytes=10, backup_count=1)


def test_fd_replaced_read_only_counts_ebadf_and_recovers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=1)
    assert w.write(record(0))
    stolen = w._fd
    ro = os.open(path, os.O_RDONLY)
    os.dup2(ro, stolen)  # same number, now read-only: write(2) fails with EBADF
    os.close(ro)
    assert w.write(record(1)) is False
    assert w.write(record(2))  # reopened by path
    assert w.errors == 1 and w.dropped_bytes == len(record(1))
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1 and "errno EBADF" in err and str(path) in err
    os.close(stolen)  # the writer must not have closed a descriptor it no longer owns
    w.close()
    assert seqs(path.read_bytes()) == [0, 2]


def test_fd_closed_underneath_counts_and_recovers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=1)
    os.close(w._fd)
    assert w.write(record(0)) is False
    assert w.write(record(1))
    w.close()
    assert w.errors == 1 and "errno EBADF" in capsys.readouterr().err
    assert seqs(path.read_bytes()) == [1]


@pytest.mark.parametrize("backup_count", [0, 2])
def test_directory_deleted_underneath_is_noticed_at_rotation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backup_count: int
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = run / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=300, backup_count=backup_count)
    notices: list[tuple[int, int, str]] = []
    w.on_loss = lambda *notice: notices.append(notice)
    size = len(record(0, pad=100))
    assert w.write(record(0, pad=100)) and w.write(record(1, pad=100))
    shutil.rmtree(run)
    assert all(w.write(record(i, pad=100)) for i in range(2, 8))  # the first rotation finds it unlinked
    assert notices == [(2, 2 * size, "trace file deleted")]
    assert (w.lost_records, w.lost_bytes, w.dropped_records, w.errors) == (2, 2 * size, 2, 0)
    err = capsys.readouterr().err
    assert err.count("otel-train:") == 1 and f"{path} was deleted" in err and "2 record(s)" in err
    w.close()
    kept = [s for p in segments(path) for s in seqs(p.read_bytes())]
    assert kept == list(range(kept[0], 8)) and kept[0] >= 2  # the directory (its parent exists) came back


def test_deleted_file_is_noticed_within_a_second_without_rotation(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=1)
    notices: list[tuple[int, int, str]] = []
    w.on_loss = lambda *notice: notices.append(notice)
    assert all(w.write(record(i)) for i in range(3))
    path.unlink()
    written, deadline = 3, time.monotonic() + 10
    while not notices and time.monotonic() < deadline:  # the ticker thread makes a write check, ~1/s
        assert w.write(record(written))
        written += 1
        time.sleep(0.02)
    assert notices == [(written - 1, sum(len(record(i)) for i in range(written - 1)), "trace file deleted")]
    assert seqs(path.read_bytes()) == [written - 1] and w.lost_records == written - 1
    assert time.monotonic() < deadline - 7  # about a second, not ten
    w.close()


def test_parent_gone_too_fails_counted_until_it_comes_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    path = run / "logs" / "t.jsonl"
    path.parent.mkdir(parents=True)
    w = RotatingFileWriter(path, max_bytes=100, backup_count=1)
    notices: list[tuple[int, int, str]] = []
    w.on_loss = lambda *notice: notices.append(notice)
    assert w.write(record(0))
    shutil.rmtree(run)
    # This one needs a rotation, which finds the file gone; logs/ is not made without run/.
    assert not w.write(record(1, pad=100)) and not w.write(record(2))
    assert not run.exists() and w.errors == 2 and w.dropped_records == 3 and notices == []
    run.mkdir()
    assert w.write(record(3))  # run/ is back: logs/ is made again, the loss announced after this record
    assert notices == [(1, len(record(0)), "trace file deleted")]
    err = capsys.readouterr().err
    assert "was deleted" in err and "errno ENOENT" in err
    w.close()
    assert seqs(path.read_bytes()) == [3]


def test_enospc_drops_warns_once_and_recovers_with_isolated_fragment(
    tiny_tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ballast = tiny_tmpfs / "ballast"
    ballast.write_bytes(b"\0" * 16384)
    path = tiny_tmpfs / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=1)
    # 3000-byte lines never end on a page boundary, so the disk fills in the middle of one.
    results = [w.write(record(i, pad=2980)) for i in range(40)]
    first_fail = results.index(False)
    assert not any(results[first_fail:])
    assert w.errors == 40 - first_fail
    assert w.dropped_bytes == sum(len(record(i, pad=2980)) for i in range(first_fail, 40))
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1 and "errno ENOSPC" in err and "records are being dropped" in err

    ballast.unlink()
    assert w.write(record(1000))
    assert w.write(record(1001))
    w.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # the file ends with a complete line
    fragment = lines[first_fail]
    assert record(first_fail, pad=2980).startswith(fragment) and 0 < len(fragment) < 3000
    assert [json.loads(x)["seq"] for x in lines[:first_fail]] == list(range(first_fail))
    assert [json.loads(x)["seq"] for x in lines[first_fail + 1 : -1]] == [1000, 1001]
    assert capsys.readouterr().err == ""  # recovery is silent; the same errno is not re-reported


CHILD = textwrap.dedent(
    """
    import json, sys
    from otel_train.exporters.jsonl.writer import RotatingFileWriter
    w = RotatingFileWriter(sys.argv[1], max_bytes=20000, backup_count=1000)
    for i in range(10**7):
        w.write(json.dumps({"seq": i, "pad": "y" * (i % 50)}).encode() + b"\\n")
        if i % 500 == 499:
            print(i + 1, flush=True)
    """
)


def test_sigkill_mid_stream_leaves_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(6):  # let it rotate a few times, then kill it while it is writing
            acknowledged = int(child.stdout.readline())
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    data = b"".join(p.read_bytes() for p in segments(path))
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" unless the kill tore the very last line
    got = [json.loads(x)["seq"] for x in lines]
    assert got == list(range(len(got)))
    next_line = json.dumps({"seq": len(got), "pad": "y" * (len(got) % 50)}).encode()
    assert next_line.startswith(tail) and tail != next_line
    assert len(got) >= acknowledged  # every write that returned before the kill is on disk


# QueuedWriter: the runtime's writer thread in front of the file (docs/runtime.md, "A trace file that
# stops answering").

def queued(path: Path, **kwargs: object) -> QueuedWriter:
    return QueuedWriter(RotatingFileWriter(path, **{"max_bytes": 1 << 20, "backup_count": 1, **kwargs}))


def test_queued_writer_writes_in_order_with_rotation(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    max_bytes, backups, total = 2000, 3, 1500
    w = queued(path, max_bytes=max_bytes, backup_count=backups)
    longest = max(len(record(i, pad=(i * 37) % 90)) for i in range(total))
    assert all(w.write(record(i, pad=(i * 37) % 90)) for i in range(total))
    assert w.flush()
    sizes = [p.stat().st_size for p in segments(path)]
    assert all(s <= max_bytes for s in sizes) and sum(sizes) <= (backups + 1) * max_bytes + longest
    kept = [s for p in segments(path) for s in seqs(p.read_bytes())]
    assert kept == list(range(kept[0], total))
    assert (w.errors, w.dropped_records, w.stalled) == (0, 0, False)
    w.close()
    w.close()
    assert w.write(record(total)) is False and not w._thread.is_alive()


def test_a_sync_point_record_is_in_the_file_when_write_returns(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = queued(path)
    assert w.write(record(0))  # the first record is a sync point
    assert seqs(path.read_bytes()) == [0]
    assert all(w.write(record(i)) for i in range(1, 50))
    w._limit = -1  # what the once-a-second ticker does
    assert w.write(record(50))
    assert seqs(path.read_bytes()) == list(range(51))
    assert w.position() == (os.stat(path).st_ino, path.stat().st_size)
    w.close()


def test_write_many_is_one_call_per_run_and_counts_each_failed_record(
    tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from otel_train.exporters.jsonl import writer as writer_module

    calls: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(writer_module.os, "write", counting_write)
    path = tiny_tmpfs / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 20, backup_count=1)
    w.write_many([record(i) for i in range(10)])
    assert len(calls) == 1 and seqs(path.read_bytes()) == list(range(10))
    (tiny_tmpfs / "ballast").write_bytes(b"\0" * 16384)
    lines = [record(i, pad=2980) for i in range(10, 40)]  # fills the disk in the middle of one
    w.write_many(lines)
    written = seqs(path.read_bytes().rsplit(b"\n", 1)[0] + b"\n")
    failed = 40 - written[-1] - 1
    assert failed > 0 and w.errors == failed and w.dropped_records == failed  # each record, as write() counts
    assert w.dropped_bytes == sum(len(line) for line in lines[-failed:])
    assert capsys.readouterr().err.count(WARNING) == 1
    w.close()


def test_a_blocked_write_never_blocks_the_caller_and_close_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from otel_train.exporters.jsonl import writer as writer_module

    monkeypatch.setattr(writer_module, "QUEUE_MAX_BYTES", 64 << 10)
    monkeypatch.setattr(writer_module, "SYNC_BYTES", 32 << 10)
    monkeypatch.setattr(writer_module, "STALL_REPORT_S", 0.3)
    path = tmp_path / "t.jsonl"
    w = queued(path)
    assert w.write(record(0))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read: a write blocks when full
    blocked = os.open(fifo, os.O_WRONLY)
    os.dup2(blocked, w.file._fd)  # the storage stops answering
    os.close(blocked)
    results, slowest = [], 0.0
    for i in range(1, 3000):
        t0 = time.monotonic()
        results.append(w.write(record(i, pad=200)))
        slowest = max(slowest, time.monotonic() - t0)
        if i % 100 == 0:
            time.sleep(0.02)
    assert slowest < 1.0  # bounded (the design: STALL_S, 0.1 s); a blocked write here was forever
    assert w.stalled and results[-1] is False and w.flush() is False
    dropped = results.count(False)
    assert w.dropped_records == dropped > 0
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 3.0  # gives up at once on a write that has not returned for 1 s
    in_fifo = b""
    deadline = time.monotonic() + 10
    while w._thread.is_alive() and time.monotonic() < deadline:  # the storage answers again: the thread ends
        try:
            in_fifo += os.read(reader, 1 << 16)
        except BlockingIOError:
            time.sleep(0.01)
    assert not w._thread.is_alive()  # it wrote the batch it was stuck in, then closed the file
    try:
        in_fifo += os.read(reader, 1 << 20)
    except BlockingIOError:
        pass
    os.close(reader)
    landed = len(seqs(path.read_bytes())) + in_fifo.count(b"\n")
    # Every record is in the file or the FIFO, or counted; the batch in progress is counted although
    # some of it may have reached the FIFO.
    assert landed + w.dropped_records >= 3000 >= landed + w.dropped_records - writer_module.BATCH_LINES
    err = capsys.readouterr().err
    assert "has stalled" in err and "at close are not written" in err, err


def fifo_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[QueuedWriter, int, list[dict]]:
    """A queued writer into a FIFO nobody reads yet (a small queue, 64 KiB; a sync point every 32 KiB), the
    FIFO's non-blocking read end, and the list its ``on_notice`` attrs are collected in."""
    from otel_train.exporters.jsonl import writer as writer_module

    monkeypatch.setattr(writer_module, "QUEUE_MAX_BYTES", 64 << 10)
    monkeypatch.setattr(writer_module, "SYNC_BYTES", 32 << 10)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    return QueuedWriter(RotatingFileWriter(fifo, max_bytes=1 << 30, backup_count=0)), reader, []


def test_a_stall_that_ends_is_announced_after_the_next_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    w, reader, notices = fifo_writer(tmp_path, monkeypatch)
    w.on_notice = lambda attrs: (notices.append(dict(attrs)), w.write(b'{"seq": -1}\n'))
    results = [w.write(record(i, pad=200)) for i in range(2000)]  # 64 KiB in the FIFO, 64 KiB queued
    dropped = results.count(False)
    assert dropped > 0 and w.stalled and notices == []
    stream = bytearray()
    deadline = time.monotonic() + 20
    while not notices and time.monotonic() < deadline:  # the reader comes back: the writer catches up
        try:
            stream += os.read(reader, 1 << 16)
        except BlockingIOError:
            pass
        w.write(record(5000))
        time.sleep(0.01)
    (notice,) = notices
    assert notice["reason"] == "trace file write stalled" and notice["dropped_records"] == dropped
    assert notice["stalled_ms"] > 0 and not w.stalled
    assert w.flush()
    w.close()
    os.set_blocking(reader, True)
    while chunk := os.read(reader, 1 << 16):  # EOF: the writer closed the FIFO
        stream += chunk
    os.close(reader)
    got = seqs(bytes(stream))
    assert got[got.index(-1) - 1] == 5000  # the notice follows the record that found the stall over
    assert [s for s in got if 0 <= s < 2000] == [i for i, ok in enumerate(results) if ok]
    err = capsys.readouterr().err
    assert "has stalled" in err and "resumed after" in err and f"{dropped} record(s)" in err


def test_a_stall_ends_behind_a_producer_faster_than_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The storage answers again, but slower than the caller makes records (the fault suite's FIFO read by
    a busy test process, CI stop 30): the queue would stay full and the stall open for ever. From the
    report on the queue's end advances at half the writer's pace, so the writer catches up and the stall
    is announced; every record dropped meanwhile is counted in the notice."""
    w, reader, notices = fifo_writer(tmp_path, monkeypatch)
    w.on_notice = lambda attrs: notices.append(dict(attrs))
    stream = bytearray()
    stop = threading.Event()

    def slow_storage() -> None:  # at most 0.2 MB/s: a sync point (32 KiB) takes longer than STALL_S
        while not stop.is_set():
            try:
                stream.extend(os.read(reader, 1024))
            except BlockingIOError:
                pass
            time.sleep(0.005)

    storage = threading.Thread(target=slow_storage, daemon=True)
    storage.start()
    results: list[bool] = []
    deadline = time.monotonic() + 30
    while not notices and time.monotonic() < deadline:
        results.append(w.write(record(len(results), pad=200)))
    stop.set()
    storage.join(5)
    assert notices, f"the stall never ended: {len(results)} records made, {results.count(False)} dropped"
    (notice,) = notices
    assert notice["reason"] == "trace file write stalled"
    assert notice["dropped_records"] == results.count(False) > 0
    w.close()
    os.close(reader)
    err = capsys.readouterr().err
    assert "has stalled" in err and "resumed after" in err, err


def test_a_fork_child_never_writes_or_waits_through_the_parents_writer(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = queued(path)
    assert w.write(record(0))
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            code = 0 if (w.write(record(1)) is False and w.flush() is False) else 1
            w.close()
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert w.write(record(2)) and w.flush()
    assert seqs(path.read_bytes()) == [0, 2]
    w.close()


def test_a_rotation_renames_only_the_segments_that_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # backup_count=1000 made every rotation 1000 renames; on a loaded machine a SIGTERM's shutdown then
    # waited on a writer thread that was still renaming segments that never existed.
    from otel_train.exporters.jsonl import writer as writer_module

    renames: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(writer_module.os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b))[1])
    path = tmp_path / "t.jsonl"
    (tmp_path / "t.jsonl.3").write_bytes(record(-1))  # an earlier writer's oldest segment
    w = RotatingFileWriter(path, max_bytes=300, backup_count=1000)
    for i in range(40):
        w.write(record(i, pad=100))
    w.close()
    rotations = sum(1 for _, dst in renames if dst == f"{path}.1")
    assert rotations >= 10
    # the k-th rotation (from 0) renames 3 + k + 1 names (the earlier segment .3 counted from the start), not 1000
    assert len(renames) == sum(3 + k + 1 for k in range(rotations))
    kept = sorted(int(p.name.rsplit(".", 1)[1]) for p in tmp_path.glob("t.jsonl.*"))
    assert kept == [*range(1, rotations + 1), rotations + 3]  # nothing lost: every segment, the old one moved up
    assert seqs((tmp_path / f"t.jsonl.{rotations + 3}").read_bytes()) == [-1]
    written = [s for n in range(rotations, 0, -1) for s in seqs((tmp_path / f"t.jsonl.{n}").read_bytes())]
    assert written + seqs(path.read_bytes()) == list(range(40))


SLOW_DISK_AT_SHUTDOWN = r"""
import os, sys, time
import otel_train as ot
from otel_train.exporters.jsonl import writer as writer_module

real_write, slow = os.write, []

def write(fd, data):
    if slow:
        time.sleep(0.3)  # a slow disk: every write returns, each after 0.3 s (never stuck: progress)
    return real_write(fd, data)

writer_module.os.write = write
ot.init(save_path=sys.argv[1], enabled=True, run_id="slow-disk", digest_s=0)
with ot.log_trace_span("warm"):
    pass
slow.append(True)
for i in range(40 * writer_module.BATCH_LINES):  # about 40 batches of 0.3 s each queued for the writer
    ot.log_trace_instant("tick", i=i)
t0 = time.monotonic()
ot.shutdown(1.0)
print(f"{time.monotonic() - t0:.3f}", flush=True)
"""


def test_shutdown_keeps_its_deadline_with_a_slow_disk(tmp_path: Path) -> None:
    # Each wait on the writer is bounded, but shutdown reads five counters and closes: a writer that is
    # slow yet making progress made each take its whole 3 s (a SIGTERM'd process lived 15 s and more).
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-c", SLOW_DISK_AT_SHUTDOWN, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    elapsed = float(proc.stdout.split()[-1])
    from otel_train.runtime import SHUTDOWN_FILE_FLOOR_S

    assert elapsed < 1.0 + SHUTDOWN_FILE_FLOOR_S + 2.5, elapsed  # before: 12 s (until the writer caught up)
    assert re.search(r"\d+ record\(s\) of this process are not in its trace file", proc.stderr), proc.stderr
    (trace,) = (tmp_path / "structured_logs").glob("*.jsonl")
    data = trace.read_bytes()
    assert data.endswith(b"\n") and all(json.loads(line) for line in data.splitlines())  # whole lines, in order
