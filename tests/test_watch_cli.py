"""``otel-train watch`` as users run it (a subprocess): exit codes, waiting for a run, JSON lines,
``--on-finding``, ``--exit-on``, the text table."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from analysis_fixtures import Proc, write_run

from otel_train.phases import FORWARD

CLI = [sys.executable, "-m", "otel_train.cli", "watch"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _failed_run(tmp_path: Path) -> Path:
    """A finished run on another host: rank 1 raised in forward at step 3, both shut down."""
    procs = [Proc(rank=r, host="elsewhere") for r in (0, 1)]
    for p in procs:
        p.steps(range(3))
    procs[1].fail(3, FORWARD)
    for p in procs:
        p.shutdown()
    write_run(tmp_path / "run", procs)
    return tmp_path / "run"


def test_json_lines_for_a_finished_run_end_by_themselves(tmp_path: Path) -> None:
    done = _run(str(_failed_run(tmp_path)), "--json")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["type"] for e in events] == ["finding", "end"]
    f = events[0]["finding"]
    assert (f["kind"], f["rank"], f["attempt"], f["step"], f["phase"], f["victims"]) == ("error", 1, 0, 3, FORWARD, [])
    assert events[1]["processes"] == 2 and events[1]["findings"] == 1 and events[1]["ts"] >= events[0]["ts"]


def test_exit_on_a_kind_exits_3_after_printing_it_and_on_finding_gets_its_json(tmp_path: Path) -> None:
    out = tmp_path / "hook.json"
    done = _run(str(_failed_run(tmp_path)), "--json", "--exit-on", "hang,error", "--on-finding", f"cat > {out}")
    assert done.returncode == 3, done.stderr
    assert [json.loads(line)["type"] for line in done.stdout.splitlines()] == ["finding", "end"]
    assert json.loads(out.read_text())["kind"] == "error"  # the hook ran before watch exited


def test_a_run_that_never_starts_is_waited_for_until_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _run(str(tmp_path / "not-yet"), "--json", "--timeout", "1.5")
    assert done.returncode == 0 and time.monotonic() - started >= 1.5
    (end,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert end["type"] == "end" and end["processes"] == 0


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    done = _run(str(tmp_path), "--exit-on", "hang,oops", "--timeout", "1")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "oops" in done.stderr
    (tmp_path / "file").write_text("x")
    done = _run(str(tmp_path / "file"), "--timeout", "1")
    assert done.returncode == 2 and done.stderr.startswith("error:") and "not a directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_text_mode_prints_the_table_and_the_findings(tmp_path: Path) -> None:
    done = _run(str(_failed_run(tmp_path)))
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.replace("┃", " ").replace("│", " ").split())
    assert "rank att step open spans open for state" in text
    assert "0 0 2 - - ended" in text and "1 0 3 - - ended" in text
    assert "error: rank 1 (attempt 0): forward raised RuntimeError: boom at step 3" in text
