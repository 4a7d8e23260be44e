"""The tail that live ``watch`` and ``push --follow`` read through: rotation while it reads."""

from __future__ import annotations

import os
from pathlib import Path

from analysis_fixtures import Proc, write_run

from otel_train import schema
from otel_train.analysis.reading.tails import Tail


def _records(polled: list) -> list[tuple[str, str, float]]:
    return [(type(r).__name__, r.name, r.ts) for _, records in polled for r in records]


def test_a_segment_one_poll_missed_in_a_rotation_is_not_read_again(tmp_path: Path) -> None:
    # Seen in a fresh-clone run (tests/test_push_follow.py): rotation renamed the active file between
    # the tail's listing and its open, that poll did not see the segment, the tail forgot it, and the
    # next poll read the whole segment again: spans shipped twice.
    proc = Proc(rank=0)
    proc.steps(range(4))
    write_run(tmp_path, [proc])
    logs = tmp_path / schema.STRUCTURED_LOGS_DIR
    active = logs / proc.file_name
    tail = Tail(tmp_path)
    first = _records(tail.poll())
    assert len(first) == len(proc.lines)
    aside = tmp_path / "aside"
    aside.mkdir()
    os.replace(active, aside / proc.file_name)  # renamed under the tail: this poll cannot see it
    assert tail.poll() == []
    os.replace(aside / proc.file_name, logs / (proc.file_name + ".1"))  # ... it was the rotated segment
    more = Proc(rank=0, rand=proc.rand, pid=proc.pid)
    more._seq, more.now_ms = len(proc.lines), proc.now_ms + 1.0
    more.steps(range(4, 6))
    active.write_text("\n".join(more.lines[1:]) + "\n")  # the new active file, past process_start
    again = _records(tail.poll())
    assert len(again) == len(more.lines) - 1 and not set(again) & set(first), again  # only the new file


def test_a_deleted_segment_is_forgotten_after_two_polls(tmp_path: Path) -> None:
    proc = Proc(rank=0)
    proc.steps(range(2))
    write_run(tmp_path, [proc])
    tail = Tail(tmp_path)
    tail.poll()
    (tmp_path / schema.STRUCTURED_LOGS_DIR / proc.file_name).unlink()
    tail.poll()
    assert len(tail._segments) == 1  # one miss may be a rename in flight
    tail.poll()
    assert tail._segments == {}
