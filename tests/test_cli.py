"""The summarize and stats commands: JSON contract, exit codes, one-line errors, CSV, a real subprocess."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from typer.testing import CliRunner

from otel_train import schema
from otel_train.cli import app
from otel_train.phases import BACKWARD, DATA_FETCH

CLI = Path(sys.executable).with_name("otel-train")
CONTRACT_KEYS = {
    "processes": {"rank", "attempt", "source", "host", "pid", "final_step", "relative_step", "last_event",
                  "last_ts", "open_spans"},
    "unclosed": {"rank", "attempt", "name", "step", "span_id", "start_ts"},
    "phases": {"name", "count", "p50_ms", "p95_ms", "max_ms", "slowest"},
    "findings": {"kind", "rank", "step", "phase", "message"},
}


@pytest.fixture()
def hung_run(tmp_path: Path) -> Path:
    procs = [Proc(rank=r, world_size=3) for r in range(3)]
    for p in procs:
        p.steps(range(6))
        p.stop_inside(6, [DATA_FETCH] if p.rank == 1 else [BACKWARD])
        p.shutdown()
    write_run(tmp_path / "run", procs, garbage={4: b"\x00\x01 not json"})
    return tmp_path / "run"


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_summarize_json_matches_the_contract(hung_run: Path) -> None:
    result = _invoke("summarize", str(hung_run), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["malformed_lines"] == 3
    for key, fields in CONTRACT_KEYS.items():
        assert summary[key], key
        for row in summary[key]:
            assert fields <= row.keys(), (key, fields - row.keys())
    assert set(summary["phases"][0]["slowest"]) >= {"rank", "attempt", "step", "dur_ms"}
    assert [(f["kind"], f["rank"], f["phase"]) for f in summary["findings"]] == [("hang", 1, DATA_FETCH)]
    assert summary["processes"][1]["open_spans"] == ["step", DATA_FETCH]
    assert "skipped malformed line" in result.stderr and ":5:" in result.stderr


def test_summarize_text_puts_findings_first(hung_run: Path) -> None:
    result = _invoke("summarize", str(hung_run / schema.STRUCTURED_LOGS_DIR))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.index("Findings") < out.index("Processes") < out.index("Phases")
    assert "hang" in out and DATA_FETCH in out


@pytest.mark.parametrize("command", ["summarize", "stats"])
def test_empty_or_missing_path_exits_2_with_one_line(tmp_path: Path, command: str) -> None:
    (tmp_path / "empty" / schema.STRUCTURED_LOGS_DIR).mkdir(parents=True)
    for target in (tmp_path / "empty", tmp_path / "missing"):
        result = _invoke(command, str(target))
        assert result.exit_code == 2
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(target) in lines[0]


def test_stats_json_and_csv(hung_run: Path, tmp_path: Path) -> None:
    out_csv = tmp_path / "steps.csv"
    result = _invoke("stats", str(hung_run), "--json", "--csv", str(out_csv))
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    rows = [r for r in stats["phases"] if r["name"] == "forward"]
    assert [(r["rank"], r["count"]) for r in rows] == [(0, 6), (1, 6), (2, 6)]
    assert rows[0]["p50_ms"] == pytest.approx(20.0)
    step0 = next(r for r in stats["steps"] if r["rank"] == 0 and r["step"] == 0)
    # 4 phases of 70 ms in a 75 ms step: 5 gaps of 1 ms are idle.
    assert step0["step_ms"] == pytest.approx(75.0) and step0["idle_ms"] == pytest.approx(5.0)
    assert {s["phase"] for s in stats["straggler_scores"]} >= {DATA_FETCH, BACKWARD}
    assert all(s["score"] == pytest.approx(1.0) for s in stats["straggler_scores"])
    with out_csv.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 18 and float(table[0]["idle_ms"]) == pytest.approx(5.0)
    assert {"step_ms", "data_fetch_ms", "backward_ms"} <= table[0].keys()


def _epochs_again(p: Proc, marks: list[int]) -> None:
    """Rewrite ``p``'s records: epoch e from line marks[e-1] on (its steps start again each epoch)."""
    lines = []
    for i, line in enumerate(p.lines):
        rec = json.loads(line)
        if schema.EPOCH in rec:
            rec[schema.EPOCH] = sum(i >= m for m in marks)
        lines.append(json.dumps(rec))
    p.lines = lines


def test_stats_json_made_a_process_at_a_time_is_the_whole_text(tmp_path: Path) -> None:
    from otel_train.analysis.spans import load_run
    from otel_train.analysis.stats import compute_stats
    from otel_train.cli._common import json_text
    from otel_train.cli.stats import stats_json

    again, odd, idle = Proc(rank=0, world_size=3), Proc(rank=1, world_size=3), Proc(rank=2, world_size=3)
    again.steps(range(4))
    marks = [len(again.lines)]
    again.steps(range(4))  # the second epoch's steps 0-3 again: renumbered 4-7, with (epoch, epoch_step)
    odd.steps(range(3), {"fetch\u202e\x7f": 5.0, BACKWARD: 9.0})  # a bidi control, DEL
    odd.step(3, {"fetch\u202e\x7f": 5.0})  # no backward: a gap in its column
    for p in (again, odd, idle):  # rank 2 records no step at all: no rows between rank 0's and rank 1's
        p.shutdown()
    _epochs_again(again, marks)
    write_run(tmp_path / "run", [again, odd, idle])
    run = load_run(tmp_path / "run", cache=False)
    text = stats_json(run)
    assert text == json_text(compute_stats(run))
    rows = json.loads(text)["steps"]
    assert [(r["rank"], r["step"], r.get("epoch"), r.get("epoch_step")) for r in rows][3:5] == [(0, 3, 0, 3), (0, 4, 1, 0)]
    assert len(rows) == 12 and BACKWARD not in rows[-1]["phases"] and "\\u202e" in text and "\\u007f" in text
    assert _invoke("stats", str(tmp_path / "run"), "--json", "--no-cache").stdout == text
    write_run(tmp_path / "none", [Proc(rank=0, world_size=1)])  # no step anywhere: "steps": []
    run = load_run(tmp_path / "none", cache=False)
    assert stats_json(run) == json_text(compute_stats(run)) and '"steps": []' in stats_json(run)


def test_stats_text_and_unwritable_csv(hung_run: Path, tmp_path: Path) -> None:
    result = _invoke("stats", str(hung_run))
    assert result.exit_code == 0 and "Straggler score" in result.stdout
    bad = _invoke("stats", str(hung_run), "--csv", str(tmp_path / "no" / "such" / "dir.csv"))
    assert bad.exit_code == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in bad.output


def test_real_subprocess_pipe_is_quiet_and_json_parses(hung_run: Path) -> None:
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run(
        [str(CLI), "summarize", str(hung_run), "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["findings"][0]["rank"] == 1
    assert "\r" not in proc.stderr  # no progress bar into a pipe
    missing = subprocess.run([str(CLI), "stats", str(hung_run / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr
