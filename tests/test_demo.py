"""`make demo`'s script on real 4-rank torchrun jobs: each diagnosis a newcomer should see appears.

The straggler's rank and phase and its what-if cost; the hang's rank, phase and stack, named live by
`otel-train watch`; the desync's group, seq and both ops; the pipeline job's 3-D what-if table with the
slowed stage on top and its dp x pp heatmap; where the Perfetto trace is. Asserts the story's
structure, never its timings.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ReadRecords
from contention import cpu_waits, starved

from otel_train.analysis.summary import summarize

pytest.importorskip("torch.distributed")

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("demo") / "runs"
    done = subprocess.run([sys.executable, str(DEMO), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, out


def section(text: str, number: int) -> str:
    parts = re.split(r"^== ", text, flags=re.M)
    return next(p for p in parts if p.startswith(f"{number}. "))


def test_clean_run_has_no_findings(story: tuple[str, Path], read_records: ReadRecords) -> None:
    """No finding in the clean run but a straggler the shared machine made, with the kernel's word that it
    waited for a CPU (tests/contention.py): CI, busy with the suite's other jobs, named rank 0 of a clean
    demo run."""
    text, out = story
    found = summarize(out / "clean")["findings"]
    waits = cpu_waits(read_records(out / "clean"))
    assert sorted(waits) == [0, 1, 2, 3], "the clean job logs each step's wait for a CPU (--cpu-wait)"
    unexplained = [(f["kind"], f["message"]) for f in found if not starved(f, waits)]
    assert unexplained == [], unexplained
    assert ("Findings: none" in section(text, 1)) == (not found), section(text, 1)


def culprits(findings: list[dict[str, Any]], waits: dict[int, dict[int, float]]) -> list[tuple[str, int]]:
    """(kind, rank) of each finding but a straggler the machine made, with the kernel's word that it waited
    for a CPU (tests/contention.py; the straggler job logs its waits with ``--cpu-wait``)."""
    return [(f["kind"], f["rank"]) for f in findings if not starved(f, waits)]


def test_straggler_named_with_its_cost(story: tuple[str, Path], read_records: ReadRecords) -> None:
    """Rank 2, 40 ms slower in data_fetch: the one straggler, its peers its victims, no one else named."""
    text, out = story
    found = summarize(out / "straggler")["findings"]
    assert culprits(found, cpu_waits(read_records(out / "straggler"))) == [("straggler", 2)], found
    (f,) = [f for f in found if (f["kind"], f["rank"]) == ("straggler", 2)]
    assert f["phase"] == "data_fetch" and f["victims"] == [0, 1, 3] and f["cost_ms"] > 0, f
    text = section(text, 2)
    assert re.search(r"^  straggler: rank 2 .*data_fetch", text, flags=re.M), text
    assert len(re.findall(r"^  straggler: ", text, flags=re.M)) == len([g for g in found if g["kind"] == "straggler"])
    assert re.search(r"without rank 2's data_fetch slowness: [\d.]+ ms \(\d+ %\) faster per step", text), text


def test_hang_named_live_with_its_stack(story: tuple[str, Path], read_records: ReadRecords) -> None:
    """Rank 1 hangs in forward at step 8: watch's live findings (as the demo read them) name rank 1 alone,
    in forward, its three peers its victims, with rank 1's stack in train_ddp.py's hang."""
    text, out = story
    events = [json.loads(line) for line in (out / "hang" / "analysis" / "watch.jsonl").read_text().splitlines()]
    found = [e["finding"] for e in events if e["type"] == "finding"]
    assert culprits(found, cpu_waits(read_records(out / "hang", torn_ok=4))) == [("hang", 1)], found
    (f,) = [f for f in found if f["kind"] == "hang"]
    assert f["phase"] == "forward" and f["step"] == 8 and f["victims"] == [0, 2, 3], f
    assert any(frame.endswith(":hang") and "train_ddp.py" in frame for frame in f["stacks"][0]["frames"]), f["stacks"]
    text = section(text, 3)
    assert re.search(r"^  hang: rank 1 .*forward", text, flags=re.M), text
    assert re.search(r"stack: .*train_ddp\.py:\d+:hang", text), text


def test_desync_names_group_seq_and_both_ops(story: tuple[str, Path], read_records: ReadRecords) -> None:
    """Rank 3 broadcasts where ranks 0 - 2 all-reduce: one desync naming rank 3 alone, the others its
    victims, each side's op; nothing else named (no hang for the ranks left waiting)."""
    text, out = story
    found = summarize(out / "desync")["findings"]
    assert culprits(found, cpu_waits(read_records(out / "desync", torn_ok=4))) == [("desync", 3)], found
    (f,) = [f for f in found if f["kind"] == "desync"]
    ops = {int(r): op for r, op in f["comm"]["ops"].items()}
    assert f["ranks"] == [3] and f["victims"] == [0, 1, 2], f
    assert ops == {0: "all_reduce", 1: "all_reduce", 2: "all_reduce", 3: "broadcast"}, f
    line = next((ln for ln in section(text, 4).splitlines() if "desync:" in ln), "")
    assert f"group {f['comm']['group']}" in line and f"seq {f['comm']['seq']}" in line, line
    assert "rank 3 broadcast" in line and "ranks 0, 1, 2 all_reduce" in line, line


def test_ends_with_the_perfetto_trace_and_the_heatmap(story: tuple[str, Path]) -> None:
    text, out = story
    trace = out / "straggler" / "analysis" / "structured_trace.json"
    assert trace.is_file() and str(trace) in text and "vizviewer" in text
    heat = out / "straggler" / "analysis" / "whatif.png"
    assert heat.read_bytes().startswith(b"\x89PNG") and str(heat) in text
    # One finding a line: the straggler's, with its comm clause and the numbers of the run, is the
    # longest (400 - 420 characters seen); nothing near a dump.
    assert len(max(text.splitlines(), key=len)) < 600


def test_pipeline_whatif_table_puts_the_slowed_stage_on_top(story: tuple[str, Path]) -> None:
    text = section(story[0], 5)
    assert "whatif" in text and "--method typical" in text and re.search(r"slowdown S = [\d.]+x", text), text
    rows = {dim: [(int(i), float(x)) for i, x in re.findall(rf"│ {dim}\s+│\s+(\d+) │\s+([\d.]+)x", text)]
            for dim in ("dp", "pp")}
    assert sorted(i for i, _ in rows["pp"]) == [0, 1] and sorted(i for i, _ in rows["dp"]) == [0, 1], text
    assert max(rows["pp"], key=lambda r: r[1])[0] == 1, rows  # stage 1 was slowed
    assert "last stage" in text, text


def test_pipeline_heatmap_is_written_and_named(story: tuple[str, Path]) -> None:
    text, out = story
    heat = out / "pipeline" / "analysis" / "whatif-heatmap.png"
    assert heat.read_bytes().startswith(b"\x89PNG") and str(heat) in section(text, 5)
    assert "data-parallel rank x pipeline stage" in text.split("== Where to look next")[-1]
