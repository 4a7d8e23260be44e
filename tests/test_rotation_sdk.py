"""Rotation through the SDK: disk use stays bounded and ``seq`` runs gapless across the kept segments."""

from __future__ import annotations

import os
from pathlib import Path

import otel_train as ot
from otel_train import schema as S

from conftest import ReadRecords, trace_segments

MAX_MB = 0.01
MAX_BYTES = int(MAX_MB * 1024 * 1024)


def train_and_watch(save_path: Path, steps: int) -> tuple[int, int, int]:
    """Run ``steps`` training steps; return the most bytes and files ever seen on disk, and the longest line."""
    log_dir = save_path / S.STRUCTURED_LOGS_DIR
    most_bytes = most_files = 0
    for i in range(steps):
        with ot.training_step(i):
            with ot.log_trace_span("forward", micro=i % 3):
                ot.log_trace_scalar({"loss": 1.0 / (i + 1), "lr": 1e-3})
            with ot.log_trace_span("optimizer"):
                pass
        sizes = [entry.stat().st_size for entry in os.scandir(log_dir)]
        most_bytes, most_files = max(most_bytes, sum(sizes)), max(most_files, len(sizes))
    ot.shutdown()
    longest = max(len(line) + 1 for segs in trace_segments(save_path) for p in segs
                  for line in p.read_bytes().splitlines())
    return most_bytes, most_files, longest


def test_rotation_keeps_backup_count_segments_with_gapless_seq(tmp_path: Path, read_records: ReadRecords) -> None:
    ot.init(save_path=tmp_path, enabled=True, max_file_size_mb=MAX_MB, backup_count=2)
    most_bytes, most_files, longest = train_and_watch(tmp_path, 1500)

    assert most_files == 3 and most_bytes <= 3 * MAX_BYTES + longest
    [segments] = trace_segments(tmp_path)
    assert [p.name.rsplit(S.FILE_SUFFIX, 1)[1] for p in segments] == [".2", ".1", ""]
    assert all(p.stat().st_size <= MAX_BYTES for p in segments)  # every line is shorter than a segment

    records = read_records(tmp_path)
    seqs = [r[S.SEQ] for r in records]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # oldest .2 -> .1 -> active, nothing missing
    assert seqs[0] > 1  # the oldest records were rotated away, as configured
    end = records[-1]
    assert end[S.NAME] == S.INSTANT_PROCESS_END and end[S.ATTRS]["records"] == end[S.SEQ]
    assert end[S.ATTRS]["write_errors"] == 0
    assert records[-2][S.EVENT] == "step_end" and records[-2][S.STEP] == 1499


def test_backup_count_zero_keeps_one_bounded_file(tmp_path: Path, read_records: ReadRecords) -> None:
    ot.init(save_path=tmp_path, enabled=True, max_file_size_mb=MAX_MB, backup_count=0)
    most_bytes, most_files, longest = train_and_watch(tmp_path, 600)

    assert most_files == 1 and most_bytes <= MAX_BYTES + longest
    records = read_records(tmp_path)
    seqs = [r[S.SEQ] for r in records]
    assert seqs[0] > 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert records[-1][S.NAME] == S.INSTANT_PROCESS_END and records[-1][S.ATTRS]["records"] == seqs[-1]
