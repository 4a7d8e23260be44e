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
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from faultlib import reported, trials

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
RAW_CONTROL = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\x8e\x8f\xaa-\xae]|"
                         rb"\xe2\x81[\xa6-\xa9]|\xd8\x9c|\xed[\xa0-\xbf]")
"""A raw control byte in UTF-8 output: C0 but tab and newline (a carriage return overwrites a line),
DEL, C1, bidi marks, overrides and isolates, and an encoded lone surrogate (surrogateescape)."""


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
    holds = "a crash with gloo's real error text ([/__w/pytorch/.../pair.cc:553] ...): summarize exits 0 and shows it whole"
    with reported("gloo's error text in a crash", holds, 1):
        _gloo_error_shown(hostile_run)


def _gloo_error_shown(hostile_run: Path) -> None:
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
    holds = "summarize's tables in a pipe: a 120-column phase name and process_end whole; COLUMNS=60 still wins"
    with reported("tables in a pipe (not a terminal)", holds, 1):
        _tables_in_a_pipe(tmp_path)


def _tables_in_a_pipe(tmp_path: Path) -> None:
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


# Generated hostile strings (issue 19's target: 2,000 of them through every command). Each string is
# a few pieces drawn from these families; one string per run is 1 MB.
PIECES = {
    "markup": ["[bold red]", "[/bold red]", "[/]", "[link=https://evil.example]", "[/link]", "[", "]", "\\[",
               "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]", ":smile:", "[on #ff0000]",
               "[blink]", "[@click=app.quit]"],
    "escape": ["\x1b[31m", "\x1b[0m", "\x1b[2J", "\x1b[H", "\x1b]52;c;ZWNobyBwd25lZA==\x07", "\x1bc",
               "\x1b]8;;https://evil.example\x1b\\", "\x1b]0;title\x07", "\x1bP+q544e\x1b\\", "\x9b2J",
               "\x9d0;t\x9c", "\x1b[6n", "\x1b"],
    "bidi": ["\u202e", "\u202d", "\u202a", "\u202b", "\u202c", "\u2066", "\u2067", "\u2068", "\u2069",
             "\u200e", "\u200f", "\u061c"],
    "control": ["\x00", "\x07", "\x08", "\x7f", "\r", "\x0b", "\x0c", "\x85", "\t", "\n", "\x1f"],
    "surrogate": ["\ud800", "\udcff", "\udfff", "\ud83d"],
    "text": ["load", "data_fetch", "shard-7", "\u00e9t\u00e9", "\u6570\u636e", "\U0001f525", "a" * 40, " ",
             "%s", "{0}", "${HOME}", "\\", '"', "'", "<script>", "|", "\u0301"],
}
STRINGS_PER_RUN = 100
MAX_RUNS = 20
"""``make faults`` runs 20 runs of 100 strings (2,000); ``make test`` one."""


def hostile_strings(rnd: random.Random, count: int) -> list[str]:
    """``count`` distinct strings of 1 to 8 pieces from random families; the last one is 1 MB."""
    families = sorted(PIECES)
    out: set[str] = set()
    while len(out) < count - 1:
        out.add("".join(rnd.choice(PIECES[rnd.choice(families)]) for _ in range(rnd.randint(1, 8))))
    big = rnd.choice(PIECES["markup"]) + rnd.choice(PIECES["escape"]) + "x" * 1_000_000 + rnd.choice(PIECES["bidi"])
    return [*sorted(out), big]


def hostile_generated_run(root: Path, strings: list[str]) -> Path:
    """A 3-rank run that wears ``strings`` everywhere text reaches output: host names, phase names (rank
    1 slower in the first), a crash's exception type and message, the spans two ranks stop inside, stall
    instants' spans, thread names and stack frames; the 1 MB string is the crash's message.

    A record holding a lone surrogate is a malformed line (our writer never writes one: it writes
    U+FFFD, docs/runtime.md), skipped and counted: those strings go into the stall records, last, so
    that the others reach the output."""
    lone = re.compile("[\ud800-\udfff]")
    s = iter(sorted(strings[:-1], key=lambda x: bool(lone.search(x))))
    hosts = [next(s) for _ in range(3)]
    phases = [next(s) for _ in range(16)]
    procs = [Proc(rank=r, world_size=3, host=hosts[r]) for r in range(3)]
    for step in range(8):
        for p in procs:
            p.step(step, {name: 1.0 + (6.0 if p.rank == 1 and i == 0 else 0.0) for i, name in enumerate(phases)})
    procs[0].fail(8, next(s), next(s), strings[-1])
    procs[1].stop_inside(8, [next(s), next(s)])
    procs[2].stop_inside(8, [next(s), next(s)])
    rest = list(s)
    for i in range(0, len(rest) - 2, 3):
        procs[1 + i % 2].instant("stall", span=rest[i], open_s=30.0, threshold_s=10.0,
                                 stacks=[{"tid": 1, "thread": rest[i + 1], "frames": [f"{rest[i + 2]}:1:f"]}])
    procs[0].shutdown()
    write_run(root, procs)
    return root


def phase_of(run: Path) -> str:
    """The slowed phase of :func:`hostile_generated_run`'s run (rank 1's first phase)."""
    for line in next((run / "structured_logs").glob("*rank_1.*")).read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "span_start" and rec["name"] != "step":
            return rec["name"]
    raise AssertionError("no phase")


GENERATED_COMMANDS = [*COMMANDS[:8], ("watch", "--timeout", "1"), ("watch", "--json", "--timeout", "1")]


def _check_output(out: subprocess.CompletedProcess[bytes], command: tuple[str, ...], seed: int) -> None:
    where = (seed, command, out.stderr.decode(errors="replace")[-500:])
    assert out.returncode in (0, 2), where
    for stream in (out.stdout, out.stderr):
        raw = RAW_CONTROL.search(stream)
        assert raw is None and b"Traceback" not in stream, (where, raw and stream[max(raw.start() - 40, 0):raw.end() + 40])
    if "--json" in command:
        lines = out.stdout.decode().splitlines() if command[0] == "watch" else [out.stdout.decode()]
        for line in lines:
            json.loads(line)


def test_generated_hostile_strings_through_every_command(tmp_path: Path) -> None:
    runs = min(trials(1), MAX_RUNS)
    holds = (f"{STRINGS_PER_RUN} generated strings a run (rich markup, ANSI/OSC/DCS sequences, C0/C1 controls, "
             "bidi controls, NUL, lone surrogates, one 1 MB string) as hosts, phases, a crash's type and message, "
             "open spans, stall stacks: summarize (--fast), stats, whatif, watch, diff, export chrome/perfetto, "
             "text and --json: exit 0 or 2, no raw control byte on stdout or stderr, JSON valid")
    with reported("hostile text: generated strings through every command", holds, runs * STRINGS_PER_RUN):
        for seed in range(runs):
            run = hostile_generated_run(tmp_path / f"run{seed}", hostile_strings(random.Random(seed), STRINGS_PER_RUN))
            for command in GENERATED_COMMANDS:
                out = cli(*command, str(run))
                _check_output(out, command, seed)
                if command == ("summarize",):  # the slow phase is named, as visible escapes
                    text = out.stdout.decode()  # a newline in a name breaks it over lines of a table cell
                    assert all(part in text for part in printable(phase_of(run)).split("\n")), (seed, text[-2000:])
            for command in (("diff", str(run), str(run)), ("diff", str(run), str(run), "--json")):
                _check_output(cli(*command), command, seed)
            for fmt in ("chrome", "perfetto"):
                target = tmp_path / f"t{seed}.{fmt}"
                out = cli("export", str(run), "--format", fmt, "--output", str(target))
                _check_output(out, ("export", fmt), seed)
                if fmt == "chrome":
                    json.loads(target.read_bytes())
