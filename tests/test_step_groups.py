"""Grouped step traces: step N of the ranks of one group (``rank // trace_group_size``) shares a trace, every
step span links to the step's anchor (rank 0's step span in group 0's trace), all ids derived from run id,
step, group and attempt; the JSONL files carry the same ids, and ``push`` replays the same links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from otlp_receivers import GrpcOtlpReceiver

import otel_train as ot
from otel_train import schema

RUN_ID = "grouped-run"
WORLD = 10
GROUP = 4  # groups {0..3}, {4..7}, {8, 9}
STEPS = (7, 8)
CLI = Path(sys.executable).with_name("otel-train")


def _train_every_rank(save_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Each rank in turn in this process: init, two traced steps with a phase inside, shutdown."""
    for key in [k for k in os.environ if k.startswith(("OTEL_", "RANK", "WORLD_SIZE", "TORCHELASTIC"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    for rank in range(WORLD):
        ot.init(save_path=save_path, enabled=True, rank=rank, world_size=WORLD, run_id=RUN_ID,
                trace_group_size=GROUP, traces_exporter="jsonl,otlp", watchdog=False)
        for step in STEPS:
            with ot.training_step(step):
                with ot.log_trace_span("forward"):
                    pass
        ot.shutdown(timeout_s=10)


def _step_spans(spans: list[dict]) -> dict[tuple[int, int], dict]:
    return {(s["resource"]["training.rank"], s["attributes"]["training.step"]): s for s in spans if s["name"] == "step"}


def _check_grouping(steps: dict[tuple[int, int], dict]) -> None:
    for step in STEPS:
        anchor_trace = f"{schema.step_trace_id(RUN_ID, step, 0):032x}"
        anchor_span = f"{schema.step_anchor_span_id(RUN_ID, step, 0):016x}"
        for rank in range(WORLD):
            span = steps[(rank, step)]
            assert span["trace_id"] == f"{schema.step_trace_id(RUN_ID, step, rank // GROUP):032x}"
            if rank == 0:
                assert span["span_id"] == anchor_span and span["links"] == []
            else:
                assert span["links"] == [{"trace_id": anchor_trace, "span_id": anchor_span,
                                          "attributes": {schema.ATTR_LINK: schema.LINK_STEP_ANCHOR}}]
        traces = {steps[(r, step)]["trace_id"] for r in range(WORLD)}
        assert len(traces) == -(-WORLD // GROUP)  # one trace per group, never one per rank


def test_grouped_traces_and_anchor_links_live_and_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with GrpcOtlpReceiver() as live:
        _train_every_rank(tmp_path, monkeypatch, live.endpoint)
        sent = live.wait_for(WORLD * len(STEPS) * 2)
    live_steps = _step_spans(sent)
    _check_grouping(live_steps)
    per_trace: dict[str, set[int]] = defaultdict(set)
    for span in sent:
        per_trace[span["trace_id"]].add(span["resource"]["training.rank"])
    assert max(len(ranks) for ranks in per_trace.values()) <= GROUP

    # The files carry the same ids; push rebuilds the same links from them.
    records = [json.loads(line) for path in (tmp_path / schema.STRUCTURED_LOGS_DIR).glob("*.jsonl")
               for line in path.read_text().splitlines()]
    file_steps = {(r["rank"], r["step"]): r for r in records if r["kind"] == "span_start" and r["name"] == "step"}
    assert {k: (v["trace_id"], v["span_id"]) for k, v in file_steps.items()} == {
        k: (v["trace_id"], v["span_id"]) for k, v in live_steps.items()}
    with GrpcOtlpReceiver() as replayed:
        done = subprocess.run([str(CLI), "push", str(tmp_path), "--endpoint", replayed.endpoint],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        pushed = _step_spans(replayed.wait_for(WORLD * len(STEPS) * 2))
    _check_grouping(pushed)
    assert {k: v["links"] for k, v in pushed.items()} == {k: v["links"] for k, v in live_steps.items()}


def test_default_group_keeps_a_step_trace_within_64_ranks() -> None:
    ranks = range(1024)
    traces = defaultdict(set)
    for rank in ranks:
        traces[schema.step_trace_id("r", 5, rank // 64)].add(rank)
    assert len(traces) == 16 and max(map(len, traces.values())) == 64
    assert schema.step_trace_id("r", 5, 0) != schema.step_trace_id("r", 6, 0) != schema.step_trace_id("s", 5, 0)
