"""The CLI says today what it said when the answers were recorded: the same exit code, stdout, stderr and
written file, byte for byte, on fixed runs (issue 43: "the same CLI output and JSON on the demo runs").

The runs (tests/data/golden/runs.tar.xz: a clean 4-rank DDP job, a straggler on two hosts with skewed
clocks, a hang with Flight Recorder dumps and stall records, a desync, a torchtitan-format run and a
synthetic restart with rotated segments and bad lines) and the answers (tests/data/golden/expected/)
come from tests/golden_runs.py, which says how to remake them. Before the comparison each answer goes
through :func:`golden_runs.normalise`, which replaces only the temporary directories' paths and the
package version where an export states it.

A failure here is a behaviour change. If it is meant, rerun ``tests/golden_runs.py expect`` and let the
diff of ``expected/`` show the review what changed.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from golden_runs import COMMANDS, EXPECTED, answer, unpack


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return unpack(tmp_path_factory.mktemp("golden"))


def test_every_expected_answer_has_its_command() -> None:
    assert sorted(p.stem for p in EXPECTED.glob("*.txt")) == sorted(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_answer_is_unchanged(name: str, runs: dict[str, Path], tmp_path: Path) -> None:
    got = answer(name, runs, tmp_path)
    want = (EXPECTED / f"{name}.txt").read_text()
    if got != want:
        diff = list(difflib.unified_diff(want.splitlines(), got.splitlines(), "expected", "now", lineterm="", n=2))
        shown = "\n".join(diff[:80]) + (f"\n... {len(diff) - 80} more diff lines" if len(diff) > 80 else "")
        pytest.fail(f"`otel-train {' '.join(COMMANDS[name])}` changed:\n{shown}", pytrace=False)
