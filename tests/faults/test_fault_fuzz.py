"""Hostile trace files against the reader and every CLI command, in process.

Hypothesis writes runs of valid records, records with wrong-typed or out-of-range fields (a ``tid``
list, ``attrs`` a string, a step of 2**63, ``ts`` 1e20), 100,000 nested brackets, torn and binary
lines, and sometimes a FIFO or a directory named like a trace file. The reader must skip and count;
every command (found on the Typer app, so commands added later are fuzzed too) must exit 0 or 2,
print no traceback, print valid JSON with ``--json``, and finish within a per-case bound.
``FUZZ_EXAMPLES`` raises the number of cases (``make faults``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import typer.main
import typer.testing
from faultlib import EXPLORE, examples, reported
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from otlp_receivers import GrpcOtlpReceiver
from typer.testing import CliRunner

from otel_train import schema as S
from otel_train.analysis.records import Reader, TraceReadError, find_process_files
from otel_train.analysis.spans import load_run
from otel_train.cli import app

CLI = typer.main.get_command(app)  # built once: Typer rebuilds it on every invoke otherwise (~50 ms)
# Every command that reads a run from its arguments; ``mcp`` serves its tools on stdio instead (those
# tools call the same readers, and tests/test_mcp.py gives them hostile paths and SQL).
COMMANDS = sorted(name for name in CLI.commands if name != "mcp")
CASE_TIMEOUT_S = 20.0
NOW = 1_790_000_000.0

# Hypothesis picks the structure (files, segments, what kind each line is) and a seed per segment; a
# line's details come from that seed. Few draws per case keep thousands of cases affordable.
NASTY = [None, True, -1, 2**63, 2**64, -(2**63) - 1, 1e20, 1e308, -1e308, "x", "", "\udcff", [1, 2], [], {},
         {"a": [1, {"b": None}]}, 0.5, -0.0, "0" * 300]
NAMES = ["step", "forward", "backward", "optimizer", "data_fetch", "process_start", "process_end", "heartbeat",
         "stall", "x" * 200, "\u00e9t\u00e9", "a\nb", "load_shard_\udcff.bin"]
SPECIAL = {
    "deep_list": b"[" * 100_000, "deep_object": b'{"a":' * 50_000, "empty_object": b"{}", "array": b"[]",
    "null": b"null", "huge_number": b"1e999", "string": b'"just a string"', "bom": b"\xef\xbb\xbf{}",
    "nul": b"\x00" * 10,
    "tid_list": b'{"v":1,"ts":1790000000.5,"kind":"span_start","name":"x","tid":[1,2]}',
    "attrs_string": b'{"v":1,"ts":1790000000.5,"kind":"instant","name":"x","attrs":"s"}',
    "step_2_63": b'{"v":1,"ts":1790000000.5,"kind":"instant","name":"x","step":9223372036854775808}',
    "ts_1e20": b'{"v":1,"ts":1e20,"kind":"instant","name":"x"}',
}
LINE_KINDS = ["valid"] * 6 + ["broken"] * 3 + ["torn", "garbage"] + sorted(SPECIAL)


def _record(rnd: random.Random) -> dict[str, Any]:
    kind = rnd.choice(S.KINDS)
    name = rnd.choice(NAMES)
    rec: dict[str, Any] = {
        S.V: 1, S.TS: NOW + rnd.uniform(0, 1e4), S.KIND: kind, S.NAME: name,
        S.EVENT: name + {S.SPAN_START: "_start", S.SPAN_END: "_end"}.get(kind, ""),
        S.TRACE_ID: f"{rnd.getrandbits(128):032x}", S.SPAN_ID: f"{rnd.getrandbits(64):016x}",
        S.SEQ: rnd.randrange(1, 10**6), S.RANK: rnd.randrange(4), S.WORLD_SIZE: 4, S.PID: rnd.randrange(1, 5),
        S.TID: 7, S.HOST: "h", S.ATTEMPT: 0, S.RUN_ID: "r", S.SOURCE: "training",
    }
    if rnd.random() < 0.5:
        rec[S.PARENT_SPAN_ID] = f"{rnd.getrandbits(64):016x}"
    if rnd.random() < 0.7:
        rec[S.STEP] = rec[S.RELATIVE_STEP] = rnd.randrange(50)
    if kind == S.SPAN_END:
        rec[S.DUR_MS] = rnd.uniform(0, 1e4)
        rec[S.STATUS] = rnd.choice(["ok", "error", "incomplete", "weird"])
        if rec[S.STATUS] == "error":
            rec[S.ERROR] = {"type": "RuntimeError", "message": "boom"}
    if kind == S.SCALAR:
        rec[S.VALUES] = {"loss": rnd.uniform(-1e6, 1e6)}
    if rnd.random() < 0.5:
        rec[S.ATTRS] = {"i": rnd.randrange(-(2**40), 2**40), "s": "v"}
    return rec


def make_line(kind: str, seed: int) -> bytes:
    if kind in SPECIAL:
        return SPECIAL[kind]
    rnd = random.Random(seed)
    if kind == "garbage":  # binary, invalid UTF-8, anything but a newline
        return rnd.randbytes(rnd.randrange(120)).replace(b"\n", b" ")
    rec = _record(rnd)
    if kind == "broken":  # wrong types, out of range, missing fields
        for key in rnd.sample(sorted(rec), rnd.randrange(1, 4)):
            if rnd.random() < 0.7:
                rec[key] = rnd.choice(NASTY)
            else:
                del rec[key]
    line = json.dumps(rec).encode()  # ensure_ascii: a lone surrogate is written as its \\u escape
    return line[: rnd.randrange(1, len(line))] if kind == "torn" else line


FILE_NAMES = st.tuples(st.sampled_from(["training", "eval"]), st.integers(0, 3), st.sampled_from(["a1b2c3", "ffffff", "000000"]))
SEGMENT = st.tuples(st.lists(st.sampled_from(LINE_KINDS), max_size=12), st.integers(0, 2**32), st.booleans())


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    """Up to 3 processes of 1 to 3 segments; per segment the kinds of its lines, a seed for their
    details, and whether the last line ends with a newline."""
    files: dict[str, bytes] = {}
    for source, rank, rand in draw(st.lists(FILE_NAMES, max_size=3, unique=True)):
        base = S.trace_file_name(source, rank, "20260101-000000", rand)
        for segment in range(draw(st.integers(1, 3))):
            kinds, seed, newline = draw(SEGMENT)
            lines = [make_line(kind, seed + i) for i, kind in enumerate(kinds)]
            files[base if segment == 0 else f"{base}.{segment}"] = b"\n".join(lines) + (b"\n" if newline else b"")
    odd = draw(st.sets(st.sampled_from(["fifo", "dir"]), max_size=2))
    return {"files": files, "odd": sorted(odd)}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Thousands of small runs: in memory where there is a tmpfs (deleting on a disk costs ms each).
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = Path(tempfile.mkdtemp(prefix="otel-train-fuzz-", dir=shm))
        yield root
        shutil.rmtree(root, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("fuzz")


@contextmanager
def written(scratch: Path, run: dict[str, Any]) -> Iterator[Path]:
    """The run under ``scratch/run`` (made afresh for each case)."""
    root = scratch / "run"
    shutil.rmtree(root, ignore_errors=True)
    logs = root / S.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    for name, data in run["files"].items():
        (logs / name).write_bytes(data)
    if "fifo" in run["odd"]:
        os.mkfifo(logs / S.trace_file_name("training", 9, "20260101-000000", "fifo00"))
    if "dir" in run["odd"]:
        (logs / S.trace_file_name("training", 8, "20260101-000000", "dir000")).mkdir()
    yield root


class CaseTimeout(Exception):
    pass


TALLY: dict[str, dict[str, Any]] = {prop: {"cases": 0, "failed": None, "first": None, "last": None}
                                    for prop in ("reader", "cli")}


@contextmanager
def tallied(prop: str) -> Iterator[None]:
    """Count a property's cases, time them, keep the first failure (for test_fuzz_outcome_is_reported)."""
    tally = TALLY[prop]
    tally["cases"] += 1
    tally["first"] = tally["first"] or time.monotonic()
    try:
        yield
    except BaseException as exc:
        if tally["failed"] is None:
            tally["failed"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        raise
    finally:
        tally["last"] = time.monotonic()


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in this (main) thread after ``seconds``; keeps pytest-timeout's own alarm."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"no result within {seconds}s: a hang")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # pytest-timeout's alarm, less the time this case took
            signal.setitimer(signal.ITIMER_REAL, max(outer - (seconds - left), 0.01))


def _nonblank_lines(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.strip())


@settings(max_examples=examples(500), deadline=None, database=None, derandomize=not EXPLORE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(run=runs())
def test_reader_skips_and_counts_every_bad_line(scratch: Path, run: dict[str, Any]) -> None:
    with tallied("reader"), written(scratch, run) as root, bounded(CASE_TIMEOUT_S):
        warnings: list[str] = []
        try:
            found = find_process_files(root, warnings.append)
        except TraceReadError as exc:
            assert "\n" not in str(exc) and not run["files"]
            return
        reader = Reader(warn=warnings.append)
        decoded = sum(len(batch) for pf in found for batch in reader.batches(pf))
        assert decoded + reader.malformed_lines == sum(_nonblank_lines(d) for d in run["files"].values())
        assert all("\n" not in w for w in warnings)
        load_run(root, warn=warnings.append)


@pytest.fixture(scope="module")
def receiver() -> Iterator[GrpcOtlpReceiver]:
    with GrpcOtlpReceiver() as server:  # push needs a collector that answers
        yield server


def _args(command: str, root: Path, as_json: bool, endpoint: str) -> list[str]:
    params = CLI.commands[command].params
    args = [command]
    for param in params:
        if param.param_type_name == "argument":
            if command == "query" and param.name != "path":
                args.append("SELECT name, count(*), max(dur_ms) FROM spans GROUP BY name")  # its SQL
            else:
                args.append(str(root))  # PATH, or PATH_A and PATH_B (diff: the run against itself)
    options = {opt for param in params for opt in getattr(param, "opts", ())}
    if as_json and "--json" in options:
        args.append("--json")
    extra = {"watch": ["--timeout", "0.3"], "push": ["--endpoint", endpoint, "--timeout", "2"],
             "export": ["--output", str(root / "out.json")]}
    return args + extra.get(command, [])


@settings(max_examples=examples(700), deadline=None, database=None, derandomize=not EXPLORE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(run=runs(), command=st.sampled_from(COMMANDS), as_json=st.booleans())
def test_every_command_on_hostile_runs(scratch: Path, run: dict[str, Any], command: str, as_json: bool,
                                       receiver: GrpcOtlpReceiver) -> None:
    with tallied("cli"), written(scratch, run) as root:
        args = _args(command, root, as_json, receiver.endpoint)
        with bounded(CASE_TIMEOUT_S), mock.patch.object(typer.testing, "_get_command", lambda _app: CLI):
            result = CliRunner().invoke(app, args, catch_exceptions=True)
        output = result.stdout + result.stderr
        assert result.exit_code in (0, 2), (args, result.exit_code, output[-2000:], result.exception)
        assert "Traceback" not in output, output[-3000:]
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
        if result.exit_code == 0 and as_json and "--json" in args:
            for line in result.stdout.splitlines() if command == "watch" else [result.stdout]:
                if line.strip():
                    json.loads(line)


@pytest.mark.parametrize("prop", ["reader", "cli"])
def test_fuzz_outcome_is_reported(prop: str) -> None:
    """One README row per property above: how many cases ran, and whether any failed."""
    tally = TALLY[prop]
    if not tally["cases"]:
        pytest.skip("the property did not run in this session")
    if prop == "reader":
        fault, holds = ("hypothesis: hostile trace files into the reader (bad types and ranges, 100k brackets, "
                        "torn, binary, FIFOs)", "every non-blank line decoded or counted as malformed; no exception")
    else:
        fault = f"hypothesis: hostile runs into every CLI command ({', '.join(COMMANDS)})"
        holds = f"exit 0 or 2, no traceback, valid --json, done within {CASE_TIMEOUT_S:.0f} s"
    with reported(fault, holds, tally["cases"], seconds=tally["last"] - tally["first"]):
        assert tally["failed"] is None, tally["failed"]


def _invoke(args: list[str]) -> Any:
    with bounded(CASE_TIMEOUT_S), mock.patch.object(typer.testing, "_get_command", lambda _app: CLI):
        return CliRunner().invoke(app, args, catch_exceptions=True)


VALID_RUN = [json.dumps(r).encode() for r in (
    {"v": 1, "ts": NOW, "kind": "instant", "event": "process_start", "name": "process_start", "rank": 0,
     "world_size": 1, "pid": 1, "host": "h", "attempt": 0, "seq": 1, "tid": 1},
    {"v": 1, "ts": NOW + 1, "kind": "span_start", "event": "step_start", "name": "step", "trace_id": "1" * 32,
     "span_id": "2" * 16, "step": 0, "relative_step": 0, "rank": 0, "pid": 1, "seq": 2, "tid": 1},
    {"v": 1, "ts": NOW + 2, "kind": "span_end", "event": "step_end", "name": "step", "trace_id": "1" * 32,
     "span_id": "2" * 16, "step": 0, "relative_step": 0, "rank": 0, "pid": 1, "seq": 3, "tid": 1,
     "dur_ms": 1000.0, "status": "ok"},
)]


@pytest.mark.parametrize("odd", ["fifo", "dir"])
@pytest.mark.parametrize("with_valid", [False, True])
def test_fifo_or_directory_named_like_a_trace_file(scratch: Path, odd: str, with_valid: bool,
                                                   receiver: GrpcOtlpReceiver) -> None:
    """Issue 11: every command hung forever in open() on a FIFO named like a trace file."""
    run = {"files": {S.trace_file_name("training", 0, "20260101-000000", "a1b2c3"): b"\n".join(VALID_RUN) + b"\n"}
           if with_valid else {}, "odd": [odd]}
    with reported(f"a {'FIFO' if odd == 'fifo' else 'directory'} named like a trace file"
                  f"{' next to a valid one' if with_valid else ''}, every command",
                  "exit 0 (2 when nothing else is there), a one-line warning, never a hang", len(COMMANDS)):
        for command in COMMANDS:
            with written(scratch, run) as root:
                result = _invoke(_args(command, root, True, receiver.endpoint))
            # 2: no trace files (watch waits for them until its --timeout instead, then exits 0)
            assert result.exit_code in ((0,) if with_valid else (0, 2)), (command, result.output[-2000:])
            assert "Traceback" not in result.output, command
            assert result.exception is None or isinstance(result.exception, SystemExit), (command, result.exception)
            assert "not a regular file" in result.stderr, (command, result.stderr)


ODD_RECORDS = {
    "tid is a list": {"tid": [1, 2]},
    "attrs is a string": {"attrs": "s"},
    "step of 2**63": {"step": 2**63},
    "ts of 1e20": {"ts": 1e20},
    "seq of -1 and a dict name": {"seq": -1, "name": {"x": 1}},
}


@pytest.mark.parametrize("label", sorted(ODD_RECORDS) + ["100,000 nested brackets"])
def test_one_odd_record_never_aborts_a_command(scratch: Path, label: str, receiver: GrpcOtlpReceiver) -> None:
    """Issue 11: one odd record aborted whole commands; now it is malformed: counted, warned, skipped."""
    if label in ODD_RECORDS:
        odd = json.dumps({**json.loads(VALID_RUN[1]), **ODD_RECORDS[label]}).encode()
    else:
        odd = b"[" * 100_000 + b"]" * 100_000
    lines = [VALID_RUN[0], odd, *VALID_RUN[1:]]
    run = {"files": {S.trace_file_name("training", 0, "20260101-000000", "a1b2c3"): b"\n".join(lines) + b"\n"},
           "odd": []}
    with reported(f"one odd record ({label}), every command", "exit 0; the line skipped, counted and warned about",
                  len(COMMANDS)):
        for command in COMMANDS:
            with written(scratch, run) as root:
                result = _invoke(_args(command, root, True, receiver.endpoint))
            assert result.exit_code == 0, (command, result.output[-2000:], result.exception)
            assert "Traceback" not in result.output and "malformed" in result.stderr, (command, result.stderr)


def test_an_end_whose_duration_reaches_before_1970(scratch: Path, receiver: GrpcOtlpReceiver) -> None:
    """Found by fuzzing: an orphan end at ts 0 with dur_ms 8688 began at a negative time, which no OTLP or
    Perfetto field holds, and push and export failed. A span never begins before 1970."""
    end = {**json.loads(VALID_RUN[2]), "ts": 0.0, "dur_ms": 8688.9, "span_id": "3" * 16, "status": "incomplete"}
    run = {"files": {S.trace_file_name("training", 0, "20260101-000000", "a1b2c3"):
                     b"\n".join([*VALID_RUN, json.dumps(end).encode()]) + b"\n"}, "odd": []}
    before = len(receiver.spans())
    for command in COMMANDS:
        with written(scratch, run) as root:
            result = _invoke(_args(command, root, True, receiver.endpoint))
        assert result.exit_code == 0, (command, result.output[-2000:], result.exception)
    pushed = {s["span_id"]: s for s in receiver.spans()[before:]}
    assert pushed["3" * 16]["start_time_unix_nano"] == 0 and pushed["3" * 16]["end_time_unix_nano"] == 0
