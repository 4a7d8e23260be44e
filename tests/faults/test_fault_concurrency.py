"""8 threads and 200 asyncio tasks writing at once, with rotation: every line whole, every parent right,
seq gapless, the size bound held."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from faultlib import assert_clean_end, assert_gapless, reported, traces, trials

import otel_train as ot
from otel_train import schema as S

THREADS, TASKS, MAX_MB = 8, 200, 0.05
MAX_BYTES = int(MAX_MB * 1024 * 1024)


def _thread(label: int, start: threading.Barrier) -> None:
    start.wait()
    with ot.log_trace_span("thread", thread=label):
        for j in range(60):
            with ot.log_trace_span("work", thread=label, j=j):
                ot.log_trace_instant("tick", thread=label, j=j)


async def _task(label: int) -> None:
    with ot.log_trace_span("task", task=label):
        for j in range(4):
            with ot.log_trace_span("in_task", task=label, j=j):
                await asyncio.sleep(0)  # interleave with every other task on this loop
                ot.log_trace_instant("tock", task=label, j=j)


async def _tasks() -> None:
    await asyncio.gather(*(_task(i) for i in range(TASKS)))


def _run(save_path: Path, backup_count: int) -> None:
    ot.init(save_path=save_path, enabled=True, max_file_size_mb=MAX_MB, backup_count=backup_count)
    ot.set_step(1)
    start = threading.Barrier(THREADS + 1)
    threads = [threading.Thread(target=_thread, args=(t, start)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    start.wait()
    asyncio.run(_tasks())
    for thread in threads:
        thread.join()
    ot.shutdown()


def _check_parents(records: list[dict]) -> int:
    """Each child span's parent is its own task's or thread's span; each instant sits in its own span.
    Records whose parent or span was rotated away (a small backup_count) are not checked."""
    starts = {r[S.SPAN_ID]: r for r in records if r[S.KIND] == S.SPAN_START}
    owner = {("task", r[S.ATTRS]["task"]): r for r in starts.values() if r[S.NAME] == "task"}
    owner |= {("thread", r[S.ATTRS]["thread"]): r for r in starts.values() if r[S.NAME] == "thread"}
    checked = 0
    for r in starts.values():
        if r[S.NAME] in ("in_task", "work"):
            key = ("task", r[S.ATTRS]["task"]) if r[S.NAME] == "in_task" else ("thread", r[S.ATTRS]["thread"])
            parent = owner.get(key)
            if parent is None:
                continue
            assert r[S.PARENT_SPAN_ID] == parent[S.SPAN_ID] and r[S.TRACE_ID] == parent[S.TRACE_ID], r
            assert r[S.TID] == parent[S.TID]
            checked += 1
    for r in records:
        if r[S.NAME] in ("tick", "tock") and r[S.SPAN_ID] in starts:
            span = starts[r[S.SPAN_ID]]
            assert span[S.ATTRS] == r[S.ATTRS] and span[S.TID] == r[S.TID], (r, span)
            checked += 1
    return checked


@pytest.mark.parametrize("backup_count", [1000, 2])
def test_threads_and_tasks_with_rotation(tmp_path: Path, backup_count: int) -> None:
    count = trials(2)
    keep = "all segments kept" if backup_count > 3 else f"backup_count={backup_count}"
    holds = ("every line whole; seq gapless; every span's parent and every instant's span is its own task's "
             f"or thread's; each segment within max size + one record, the total within (backup_count + 1) × max")
    with reported(f"{THREADS} threads + {TASKS} asyncio tasks, rotation ({keep})", holds, count):
        for trial in range(count):
            run = tmp_path / f"run{trial}"
            _run(run, backup_count)
            (trace,) = traces(run)
            longest = max(len(json.dumps(r, ensure_ascii=False).encode()) for r in trace.records) + 64
            assert all(size <= MAX_BYTES + longest for size in trace.sizes), trace.sizes
            assert sum(trace.sizes) <= (backup_count + 1) * MAX_BYTES + longest
            if backup_count > 3:
                assert len(trace.sizes) > 3  # it rotated
                assert_clean_end(trace)
                assert _check_parents(trace.records) == THREADS * 60 * 2 + TASKS * 4 * 2
            else:
                assert not trace.torn
                assert_gapless(trace, start=None)
                assert trace.records[-1][S.NAME] == S.INSTANT_PROCESS_END
                _check_parents(trace.records)  # what is left of each parent still matches
