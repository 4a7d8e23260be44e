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

from otel_train.exporters.jsonl.writer import RotatingFileWriter

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


# The stall watch: a write that does not return (docs/runtime.md, "A trace file that stops answering").

def test_a_write_that_does_not_return_is_a_stall_reported_once_and_announced_when_it_returns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from otel_train.exporters.jsonl.writer import STALL_S, TICK_S

    path = tmp_path / "t.jsonl"
    w = RotatingFileWriter(path, max_bytes=1 << 30, backup_count=0)
    notices: list[dict] = []
    w.on_notice = lambda attrs: (notices.append(dict(attrs)), w.write(b'{"seq": -1}\n'))
    assert w.write(record(0))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read: a write blocks when full
    blocked = os.open(fifo, os.O_WRONLY)
    fcntl.fcntl(blocked, fcntl.F_SETPIPE_SZ, 4096)
    os.dup2(blocked, w._fd)  # the storage stops answering
    os.close(blocked)
    stuck_at: list[float] = []

    def training() -> None:
        for i in range(1, 200):
            stuck_at[:] = [time.monotonic()]
            w.write(record(i, pad=200))

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not w.stalled and time.monotonic() < deadline:
        time.sleep(0.01)
    found = time.monotonic()
    assert w.stalled and thread.is_alive(), "a write into a full FIFO was not judged stalled"
    assert found - stuck_at[0] >= STALL_S - TICK_S  # never before the call has been stuck STALL_S
    err = capsys.readouterr().err
    assert err.count("has stalled") == 1, err
    stream = bytearray()
    while thread.is_alive() and time.monotonic() < deadline + 10:  # the storage answers again
        try:
            stream += os.read(reader, 1 << 16)
        except BlockingIOError:
            time.sleep(0.005)
    assert not thread.is_alive()
    (notice,) = notices  # announced by the first record written once the stuck one returned
    assert notice["reason"] == "trace file write stalled" and notice["stalled_ms"] >= (STALL_S - TICK_S) * 1e3
    assert not w.stalled
    w.close()
    os.set_blocking(reader, True)
    while chunk := os.read(reader, 1 << 16):
        stream += chunk
    os.close(reader)
    got = seqs(bytes(stream))
    at = got.index(-1)
    assert [s for s in got if s != -1] == list(range(1, 200))  # every record whole and in order
    assert at >= 2 and got.count(-1) == 1  # the notice after a record written past the stall
    err = capsys.readouterr().err
    assert "resumed after" in err and "has stalled" not in err, err


def test_a_long_rotation_is_not_a_stall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rename is a call of its own for the watch: a rotation of many segments that makes progress
    # (here 40 renames of 20 ms each, 0.8 s in all) is not a write that does not return.
    from otel_train.exporters.jsonl import writer as writer_module

    path = tmp_path / "t.jsonl"
    for n in range(1, 41):
        Path(f"{path}.{n}").write_bytes(record(-n))
    w = RotatingFileWriter(path, max_bytes=300, backup_count=41)
    real_replace = os.replace
    monkeypatch.setattr(writer_module.os, "replace", lambda a, b: (time.sleep(0.02), real_replace(a, b))[1])
    w.write(record(0, pad=200))
    t0 = time.monotonic()
    w.write(record(1, pad=200))  # rotates: 41 renames
    assert time.monotonic() - t0 >= 0.8 and w.stalls == 0 and not w.stalled
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
