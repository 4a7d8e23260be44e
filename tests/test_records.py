"""Record schema v1: every field's type, and ids/parents right across threads and concurrent asyncio tasks."""

from __future__ import annotations

import asyncio
import glob
import json
import re
import threading
from pathlib import Path

import otel_train as ot

REQUIRED = {
    "v": int, "ts": float, "kind": str, "event": str, "name": str, "rank": int, "local_rank": int,
    "world_size": int, "host": str, "pid": int, "tid": int, "attempt": int, "run_id": str, "source": str,
    "seq": int,
}
OPTIONAL = {
    "trace_id": str, "span_id": str, "parent_span_id": str, "dur_ms": float, "status": str, "error": dict,
    "step": int, "relative_step": int, "epoch": int, "iteration": int, "tags": list, "job_id": str,
    "caller": str, "attrs": dict, "values": dict,
}
HEX = {"trace_id": re.compile(r"^[0-9a-f]{32}$"), "span_id": re.compile(r"^[0-9a-f]{16}$"),
       "parent_span_id": re.compile(r"^[0-9a-f]{16}$")}


def load(save_path: Path) -> list[dict]:
    (path,) = glob.glob(str(save_path / "structured_logs" / "*.jsonl"))
    lines = open(path, encoding="utf-8").read().splitlines()
    return [json.loads(line) for line in lines]


def check_schema(rec: dict) -> None:
    for key, typ in REQUIRED.items():
        assert isinstance(rec[key], typ) and not isinstance(rec[key], bool), (key, rec)
    for key, value in rec.items():
        if key in OPTIONAL:
            typ = OPTIONAL[key]
            assert isinstance(value, typ) or (typ is float and isinstance(value, int)), (key, rec)
        if key in HEX:
            assert HEX[key].match(value), (key, value)
    assert rec["v"] == 1
    assert rec["kind"] in ("span_start", "span_end", "instant", "scalar")
    if rec["kind"] == "span_start":
        assert rec["event"] == rec["name"] + "_start" and "span_id" in rec
    elif rec["kind"] == "span_end":
        assert rec["event"] == rec["name"] + "_end"
        assert rec["status"] in ("ok", "error", "incomplete") and rec["dur_ms"] >= 0
    elif rec["kind"] == "scalar":
        assert rec["event"] == "scalar" and isinstance(rec["values"], dict)


def pair_and_check(recs: list[dict]) -> dict[str, tuple[dict, dict]]:
    starts = {r["span_id"]: r for r in recs if r["kind"] == "span_start"}
    ends = {r["span_id"]: r for r in recs if r["kind"] == "span_end"}
    assert set(starts) == set(ends)
    for span_id, start in starts.items():
        end = ends[span_id]
        for key in ("trace_id", "name", "parent_span_id", "tid", "step"):
            assert start.get(key) == end.get(key), key
        assert end["ts"] >= start["ts"]
    return {span_id: (starts[span_id], ends[span_id]) for span_id in starts}


def test_every_record_matches_schema_v1(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, run_id="schema-run")
    for step in range(3):
        with ot.training_step(step, epoch=0, iteration=step * 10):
            ot.add_step_tag("warmup")
            with ot.log_trace_span("forward", shape=[4, 8]):
                ot.log_trace_scalar({"loss": 1.5, "tokens": 10})
            ot.log_trace_instant("note", text="hi")
    try:
        with ot.log_trace_span("eval"):
            raise RuntimeError("eval failed")
    except RuntimeError:
        pass
    ot.shutdown()
    recs = load(tmp_path)
    for rec in recs:
        check_schema(rec)
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
    assert {r["run_id"] for r in recs} == {"schema-run"}
    pairs = pair_and_check(recs)
    steps = {s["span_id"]: s for s, _ in pairs.values() if s["name"] == "step"}
    for start, _ in pairs.values():
        if start["name"] == "forward":
            assert start["parent_span_id"] in steps and start["tags"] == ["warmup"]
            assert start["attrs"] == {"shape": [4, 8]}


def test_threads_keep_their_own_parents(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True)
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        with ot.log_trace_span("worker", i=i):
            barrier.wait()
            for _ in range(20):
                with ot.log_trace_span("task", i=i):
                    pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ot.shutdown()
    recs = load(tmp_path)
    pairs = pair_and_check(recs)
    workers = {s["span_id"]: s for s, _ in pairs.values() if s["name"] == "worker"}
    assert len(workers) == 4 and len({w["tid"] for w in workers.values()}) == 4
    for start, _ in pairs.values():
        if start["name"] == "task":
            parent = workers[start["parent_span_id"]]
            assert parent["attrs"]["i"] == start["attrs"]["i"] and parent["tid"] == start["tid"]
    assert sorted(r["seq"] for r in recs) == list(range(1, len(recs) + 1))


def test_hundred_concurrent_asyncio_tasks(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True)

    async def task(i: int) -> None:
        with ot.log_trace_span("request", i=i):
            await asyncio.sleep(0.001 * (i % 7))
            with ot.log_trace_span("inner", i=i):
                await asyncio.sleep(0)

    async def main() -> None:
        with ot.log_trace_span("batch"):
            await asyncio.gather(*(task(i) for i in range(100)))

    asyncio.run(main())
    ot.shutdown()
    pairs = pair_and_check(load(tmp_path))
    (batch,) = [s for s, _ in pairs.values() if s["name"] == "batch"]
    requests = {s["span_id"]: s for s, _ in pairs.values() if s["name"] == "request"}
    inners = [s for s, _ in pairs.values() if s["name"] == "inner"]
    assert len(requests) == 100 and len(inners) == 100
    assert all(r["parent_span_id"] == batch["span_id"] for r in requests.values())
    for inner in inners:
        assert requests[inner["parent_span_id"]]["attrs"]["i"] == inner["attrs"]["i"]
