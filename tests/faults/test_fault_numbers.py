"""Out-of-range numbers in ``comm.*`` records (issue 48, item 9): such a span is skipped, never fatal.

Four ``comm.all_reduce`` spans of rank 1 (each its start and end lines, as the sink writes them) carry a
``comm.seq``, ``comm.bytes`` or ``comm.peer`` no column can hold (2**63 and more) or no recorder writes
(negative), one value each. Before the fix ``summarize``, ``stats``, ``whatif``, ``export`` and ``watch`` exited 1 with
an ``OverflowError`` from the op columns. What must hold: every command exits 0; the two lines are
skipped with the malformed-line warning on stderr and counted (``malformed_lines``); the rest of the
run reads as without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from analysis_fixtures import Proc, write_run
from comm_sim import declare, dp_steps
from faultlib import reported

from otel_train import schema as S

CASES = {
    "comm.seq 2**63": (S.ATTR_COMM_SEQ, 2**63),
    "comm.bytes 2**64": (S.ATTR_COMM_BYTES, 2**64),
    "comm.peer 2**70": (S.ATTR_COMM_PEER, 2**70),
    "comm.seq -1": (S.ATTR_COMM_SEQ, -1),
}
COMMANDS = (["summarize", "--json"], ["stats", "--json"], ["whatif", "--json"], ["export", "-o", "{out}"],
            ["watch", "--json", "--timeout", "5"])


def _run(root: Path, spoil: bool) -> Path:
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    declare(procs)
    dp_steps(procs, range(len(CASES) + 2))
    lines = procs[1].lines
    comm = [i for i, line in enumerate(lines) if '"comm.all_reduce"' in line]
    for n, (key, value) in enumerate(CASES.values() if spoil else ()):
        at = comm[2 * n:2 * n + 2]  # one span's start and end
        for i in at:
            record = json.loads(lines[i])
            record[S.ATTRS] = {**record[S.ATTRS], S.ATTR_COMM_GROUP: "0", S.ATTR_COMM_SEQ: n, key: value}
            lines[i] = json.dumps(record)
        assert json.loads(lines[at[0]])[S.SPAN_ID] == json.loads(lines[at[1]])[S.SPAN_ID]
    write_run(root, procs)
    return root


def _cli(args: list[str], run: Path) -> subprocess.CompletedProcess[str]:
    argv = [a.replace("{out}", str(run / "out.json")) for a in args]
    return subprocess.run([sys.executable, "-m", "otel_train.cli", argv[0], str(run), *argv[1:]],
                          capture_output=True, text=True, timeout=120)


def test_out_of_range_comm_numbers_are_skipped_and_counted(tmp_path: Path) -> None:
    holds = ("comm spans with comm.seq 2**63, comm.bytes 2**64, comm.peer 2**70, comm.seq -1: summarize, stats, "
             "whatif, export, watch exit 0; each span's 2 lines skipped with the malformed-line warning and "
             "counted in malformed_lines; the findings as without them")
    with reported("comm spans with out-of-range numbers, every command", holds, len(CASES) * len(COMMANDS)):
        clean = _cli(["summarize", "--json"], _run(tmp_path / "clean", spoil=False))
        assert clean.returncode == 0, clean.stderr[-2000:]
        run = _run(tmp_path / "run", spoil=True)
        for args in COMMANDS:
            done = _cli(args, run)
            assert done.returncode == 0, (args[0], done.stderr[-2000:])
            assert "Traceback" not in done.stderr and "OverflowError" not in done.stderr, (args[0], done.stderr[-2000:])
            assert "skipped malformed line" in done.stderr and "out of range" in done.stderr, (args[0], done.stderr[-2000:])
            if args[0] in ("summarize", "stats"):
                assert json.loads(done.stdout)["malformed_lines"] == 2 * len(CASES), args[0]
            if args[0] == "summarize":
                kinds = sorted(f["kind"] for f in json.loads(done.stdout)["findings"])
                assert kinds == sorted(f["kind"] for f in json.loads(clean.stdout)["findings"]), kinds
