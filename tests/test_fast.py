"""``summarize --fast`` against a full summarize: the same processes, unclosed spans and hang/crash/restart
findings, on synthetic runs whose files are far bigger than the first tail window."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run

from otel_train.analysis import fast
from otel_train.analysis.fast import FAST_KINDS, summarize_fast
from otel_train.analysis.summary import summarize
from otel_train.phases import BACKWARD, CHECKPOINT, DATA_FETCH, FORWARD, OPTIMIZER

WORLD = 4


def _same(tmp_path: Path) -> tuple[dict, dict]:
    full = summarize(tmp_path, warn=pytest.fail)
    quick = summarize_fast(tmp_path, warn=pytest.fail)
    full_findings = [f for f in full["findings"] if f["kind"] in FAST_KINDS]
    assert quick["processes"] == [{**row, "records": None} for row in full["processes"]]
    assert quick["unclosed"] == full["unclosed"]
    assert quick["findings"] == full_findings
    assert quick["phases"] is None
    return full, quick


def _ranks(**kw: object) -> list[Proc]:
    return [Proc(rank=r, world_size=WORLD, **kw) for r in range(WORLD)]  # type: ignore[arg-type]


@pytest.mark.parametrize("killed", [False, True], ids=["sigterm", "sigkill"])
def test_hang_culprit_from_the_tail(tmp_path: Path, killed: bool) -> None:
    procs = _ranks()
    for p in procs:
        p.steps(range(400))  # ~350 KB per file: several tail windows
    for p in procs:
        if p.rank == 2:
            p.stop_inside(400, [DATA_FETCH])
        else:
            p.set_step(400)
            p.start("step")
            for name in (DATA_FETCH, FORWARD):
                p.start(name)
                p.advance(3)
                p.end()
            p.start(BACKWARD)
            p.advance(5)
        if not killed:
            p.shutdown()
    write_run(tmp_path, procs)
    full, quick = _same(tmp_path)
    assert [(f["kind"], f["rank"]) for f in quick["findings"]] == [("hang", 2)]


def test_crash_outside_a_span_and_rotation(tmp_path: Path) -> None:
    procs = _ranks()
    for p in procs:
        p.steps(range(300))
    procs[1].set_step(300)  # dies between steps, no process_end
    for p in procs:
        if p.rank != 1:
            p.stop_inside(300, [BACKWARD])
    write_run(tmp_path, procs, lines_per_segment=200)  # the last step spans two segments
    _, quick = _same(tmp_path)
    assert [(f["kind"], f["rank"]) for f in quick["findings"]] == [("crash", 1)]


def test_restart_and_a_long_step_that_outgrows_the_first_window(tmp_path: Path) -> None:
    first = _ranks()
    for p in first:
        p.steps(range(50))
        p.stop_inside(50, [FORWARD])
    second = _ranks(attempt=1, stamp="20240101-001000", t0=1_700_000_600.0)
    for p in second:
        p.steps(range(40, 90))
        p.set_step(90)
        p.start("step")
        p.start(CHECKPOINT)
        for i in range(800):  # a checkpoint that logs a lot: the step began far before the tail
            p.instant("shard_written", shard=i, path="x" * 80)
        p.end()
        p.start(OPTIMIZER)  # every rank stopped here, together
    write_run(tmp_path, first + second)
    _, quick = _same(tmp_path)
    kinds = sorted({f["kind"] for f in quick["findings"]})
    assert "restart" in kinds and "hang" in kinds


def test_nested_open_span_whose_parent_began_before_the_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "FIRST_WINDOW", 4 << 10)
    procs = _ranks()
    for p in procs:
        p.steps(range(5))
        p.set_step(5)
        p.start("step")
        p.start(CHECKPOINT)  # opened long before the tail; still open at the end
        for i in range(300):
            p.instant("shard_written", shard=i)
        p.start("upload")
    write_run(tmp_path, procs)
    _, quick = _same(tmp_path)
    assert {tuple(p["open_spans"]) for p in quick["processes"]} == {("step", CHECKPOINT, "upload")}


def test_window_stops_growing_early_on_big_files(tmp_path: Path) -> None:
    procs = _ranks()
    for p in procs:
        p.steps(range(2000))  # ~1.7 MB per file
        p.stop_inside(2000, [FORWARD] if p.rank else [DATA_FETCH])
    write_run(tmp_path, procs)
    _same(tmp_path)
    states = [fast.tail_state(pf, attempt, meta, fast.BadLines(pytest.fail))
              for pf, attempt, meta in fast.process_order(tmp_path)]
    total = sum(len(line) + 1 for p in procs for line in p.lines) / WORLD
    assert all(s.records * 500 < total / 10 for s in states)  # read far less than a tenth of each file
