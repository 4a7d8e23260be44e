"""Run the fault suite with more trials and write its results into docs/reliability.md's table.

``python tests/faults/report.py [--trials N] [--examples N] [--no-readme] [--only TEST ...]`` (``make
faults``): runs ``pytest tests/faults`` with ``FAULT_TRIALS`` / ``FUZZ_EXAMPLES`` raised, collects the
row each test reports (fault, trials, what must hold, pass or fail), and replaces the table between
the ``reliability`` markers in docs/reliability.md. ``--only`` runs just the given tests (pytest node
ids under tests/faults) and replaces just their rows; every other row keeps its own date. Exits with
pytest's status.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"


def run_suite(trials: int, examples: int, report: Path, only: list[str]) -> int:
    env = dict(os.environ, FAULT_TRIALS=str(trials), FUZZ_EXAMPLES=str(examples), FAULT_REPORT=str(report))
    targets = [str(ROOT / "tests" / "faults" / t) for t in only] or [str(ROOT / "tests" / "faults")]
    # Two workers, one file each at a time (as make test): the clock-step file's real jobs on one, the
    # rest beside it. Each test appends its row to the report (one write of one line).
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=3000",
                            "-n", "2", "--dist", "loadfile", "--durations=20", *targets],
                           cwd=ROOT, env=env)


HEADER = ["| fault | trials | what must hold | last run |", "|---|---:|---|---|"]


def table(rows: list[dict], when: str, kept: dict[str, str] | None = None) -> str:
    """The table of ``rows`` run ``when``, beside the ``kept`` lines (fault -> its line) of rows not rerun."""
    lines = dict(kept or {})
    for row in rows:
        result = f"pass ({when}, {row['seconds']:.0f} s)" if row["ok"] else \
            f"**FAIL** ({when}): {row.get('failure') or ''}".replace("|", "\\|")
        lines[row["fault"]] = f"| {row['fault']} | {row['trials']} | {row['holds']} | {result} |"
    return "\n".join([*HEADER, *(lines[fault] for fault in sorted(lines))])


def current_rows() -> dict[str, str]:
    """The table's lines now, by fault (the first cell)."""
    readme = README.read_text(encoding="utf-8")
    body = readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip().splitlines()[len(HEADER):]
    return {line[2:].split(" | ", 1)[0]: line for line in body if line.startswith("| ")}


def write_readme(text: str) -> None:
    readme = README.read_text(encoding="utf-8")
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + text + "\n" + readme[end:], encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=100, help="trials per randomized fault (FAULT_TRIALS)")
    parser.add_argument("--examples", type=int, default=5000, help="hypothesis cases per property (FUZZ_EXAMPLES)")
    parser.add_argument("--no-readme", action="store_true", help="print the table instead of updating docs/reliability.md")
    parser.add_argument("--only", nargs="+", default=[], metavar="TEST",
                        help="run only these tests (node ids under tests/faults) and replace only their rows")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rows.jsonl"
        status = run_suite(args.trials, args.examples, report, args.only)
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    when = datetime.date.today().isoformat()
    text = table(rows, when, current_rows() if args.only else None)
    if args.no_readme:
        print(text)
    else:
        write_readme(text)
        print(f"{len(rows)} rows written to {README.relative_to(ROOT)} (pytest exit status {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
