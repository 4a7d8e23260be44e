"""Text from trace files is data (round 3, items 1, 2 and 14): rich markup, terminal escapes, bidi
controls and very long names in span names, error messages, host names and stacks reach every
command's output as visible text, never as markup or raw control bytes; tables in a pipe are not
wrapped at 80 columns.

Each command runs as the real console script in a subprocess, stdout and stderr pipes (what ``tee``
and a CI log see), on a run whose 3 ranks crashed with real gloo error text and hostile names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run

from otel_train.cli._text import clean, printable

OTEL_TRAIN = [sys.executable, "-m", "otel_train.cli"]
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.0.0.7]:43110")
HOSTILE = [
    "load[/data/shard-7]",
    "[bold red]fake[/bold red] [link=https://evil.example]click[/link]",
    "\x1b]52;c;ZWNobyBwd25lZA==\x07clipboard",  # OSC 52: writes the operator's clipboard
    "\x1b[2J\x1b[Hcleared",  # clear screen, cursor home
    "\x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\",  # OSC 8 hyperlink
    "evil\u202eexe.txt",  # right-to-left override
    "nul\x00byte\x08back\x7fdel\x9bcsi",
    ":smile: emoji code",
    "x" * 5000,
]
RAW_CONTROL = re.compile(rb"[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xae\xad\xaa-\xac]|\xe2\x81[\xa6-\xa9]")


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("hostile") / "run"
    procs = [Proc(rank=r, world_size=3, host=("node0" if r < 2 else "node\x1b[31m1")) for r in range(3)]
    for step in range(12):
        for p in procs:
            p.step(step, {name: 2.0 + (5.0 if p.rank == 1 and i == 0 else 0.0) for i, name in enumerate(HOSTILE[:6])})
    procs[0].fail(12, HOSTILE[1], "RuntimeError", GLOO)
    procs[1].stop_inside(12, [HOSTILE[0], HOSTILE[2]])
    procs[2].stop_inside(12, [HOSTILE[3], HOSTILE[8]])
    for p in procs:
        p.instant("stall", span=HOSTILE[2], open_s=30.0, threshold_s=10.0,
                  stacks=[{"tid": 1, "thread": HOSTILE[3], "frames": [f"{HOSTILE[6]}:1:{HOSTILE[5]}"]}])
    procs[0].shutdown()
    write_run(run, procs)
    return run


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    full = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | (env or {})
    return subprocess.run([*OTEL_TRAIN, *args], capture_output=True, timeout=120, env=full)


COMMANDS = [
    ("summarize",), ("summarize", "--json"), ("summarize", "--fast"), ("summarize", "--fast", "--json"),
    ("stats",), ("stats", "--json"), ("whatif",), ("whatif", "--json"),
    ("watch", "--timeout", "3"), ("watch", "--json", "--timeout", "3"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_hostile_text_is_printed_as_data(hostile_run: Path, command: tuple[str, ...]) -> None:
    out = cli(*command, str(hostile_run))
    assert out.returncode in (0, 2), out.stderr.decode(errors="replace")[-2000:]
    for stream in (out.stdout, out.stderr):
        assert not RAW_CONTROL.search(stream), RAW_CONTROL.search(stream)
        assert b"Traceback" not in stream and b"MarkupError" not in stream
    if "--json" in command:
        lines = out.stdout.decode().splitlines() if command[0] == "watch" else [out.stdout.decode()]
        for line in lines:
            json.loads(line)
    else:
        text = out.stdout.decode()
        assert "load[/data/shard-7]" in text or command[0] in ("stats", "whatif")  # markup shown, not parsed


def test_the_gloo_error_is_shown_whole(hostile_run: Path) -> None:
    out = cli("summarize", str(hostile_run))
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    text = out.stdout.decode()
    assert "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]" in text
    assert "\\x1b]52;c;" in text  # the OSC 52 write is shown as its escape


def test_diff_and_export_survive_hostile_text(hostile_run: Path, tmp_path: Path) -> None:
    out = cli("diff", str(hostile_run), str(hostile_run))
    assert out.returncode == 0 and not RAW_CONTROL.search(out.stdout + out.stderr), out.stderr.decode()[-2000:]
    for fmt in ("chrome", "perfetto"):
        out = cli("export", str(hostile_run), "--format", fmt, "--output", str(tmp_path / f"t.{fmt}"))
        assert out.returncode == 0 and not RAW_CONTROL.search(out.stdout + out.stderr), out.stderr.decode()


def test_tables_in_a_pipe_keep_their_natural_width(tmp_path: Path) -> None:
    # make demo | tee: "process_en d", "20:06:48.3 82" before; every cell must come out whole.
    long = "a_phase_name_longer_than_eighty_columns_" * 3
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for step in range(6):
        for p in procs:
            p.step(step, {long: 3.0, "forward": 2.0})
    for p in procs:
        p.shutdown()
    write_run(tmp_path / "run", procs)
    out = cli("summarize", str(tmp_path / "run"))
    assert out.returncode == 0
    assert long in out.stdout.decode() and "process_end" in out.stdout.decode()
    narrow = cli("summarize", str(tmp_path / "run"), env={"COLUMNS": "60"})
    assert max(map(len, narrow.stdout.decode().splitlines())) <= 60  # COLUMNS still wins


def test_printable_escapes_and_cuts() -> None:
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable("x\u202ey") == "x\\u202ey" and printable("lone\ud800") == "lone\\ud800"
    assert printable("tab\tand\nnewline") == "tab\tand\nnewline"
    assert printable("y" * 10, limit=4) == "yyyy… (10 characters)"
    assert clean({"k\x07": ["\x1b", 1, None]}) == {"k\\x07": ["\\x1b", 1, None]}
