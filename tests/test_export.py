"""otel-train export: Chrome JSON and Perfetto protobuf from real trace files, track layout, validator.

The Perfetto output is decoded with Perfetto's own protos (test_perfetto_protos.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from analysis_fixtures import Proc, write_run
from otel_train import schema
from otel_train.analysis.export import export
from otel_train.analysis.export.layout import assign_tracks, greedy_tracks
from otel_train.analysis.spans import Span
from otel_train.analysis.validate import validate_chrome_trace
from otel_train.cli import app

# A real training script: the SDK writes the files (asyncio tasks, a worker thread, an error, a span
# left open at shutdown, instants and scalars).
GOLDEN_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    import otel_train as ot

    ot.init(enabled=True, save_path=sys.argv[1])

    async def fetch(i):
        with ot.log_trace_span("fetch", shard=i):
            await asyncio.sleep(0.01 * (i + 1))
            with ot.log_trace_span("decode"):
                await asyncio.sleep(0.005)

    async def prefetch():
        with ot.log_trace_span("prefetch"):
            await asyncio.gather(*(fetch(i) for i in range(3)))

    for step in range(3):
        with ot.training_step(step):
            with ot.log_trace_span("forward"):
                time.sleep(0.002)
            ot.log_trace_scalar({"loss": 1.0 / (step + 1), "finite": True})
            ot.log_trace_instant("marker", note="x")
    asyncio.run(prefetch())
    asyncio.run(prefetch())  # sequential tasks reuse the tracks of the first round

    def worker():
        with ot.log_trace_span("bg"):
            time.sleep(0.01)

    th = threading.Thread(target=worker)
    th.start()
    with ot.log_trace_span("main_work"):
        time.sleep(0.02)
    th.join()
    try:
        with ot.log_trace_span("bad"):
            raise ValueError("nope")
    except ValueError:
        pass
    ot.log_trace_span("left_open").__enter__()
    ot.shutdown()
    """
)


def run_golden(save_path: Path, rank: int = 0, world_size: int = 1) -> None:
    """Run the golden script through the real SDK in a subprocess with torchrun-style env."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", GOLDEN_SCRIPT, str(save_path)], env=env, check=True, timeout=60)


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("golden")
    for rank in (1, 0):  # written out of order: the export must sort by rank
        run_golden(run, rank, 2)
    return run


def events(trace: dict, ph: str, **match: object) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph and all(e.get(k) == v for k, v in match.items())]


def export_json(run: Path, out: Path, **kw: object) -> tuple[dict, object]:
    result = export(run, "chrome", out, **kw)
    trace = json.loads(out.read_text())
    assert validate_chrome_trace(trace) == []
    return trace, result


# ---------------------------------------------------------------- golden run through the SDK


def test_golden_chrome_export(golden_run: Path, tmp_path: Path) -> None:
    trace, result = export_json(golden_run, tmp_path / "t.json")
    assert result.processes == 2
    names = {e["pid"]: e["args"]["name"] for e in events(trace, "M", name="process_name")}
    assert names == {1: "rank 0", 2: "rank 1"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events(trace, "M", name="process_sort_index")}
    assert sort == {1: 0, 2: 1}
    assert "pid" in events(trace, "M", name="process_labels")[0]["args"]["labels"]

    x = events(trace, "X", pid=1)
    assert result.slices == len(events(trace, "X")) == 2 * len(x)
    assert result.instants == len(events(trace, "i"))
    assert result.counters == len(events(trace, "C")) == 2 * 3 * 2  # ranks x steps x keys
    # Timestamps are µs since the start; the epoch is kept.
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) == 0
    assert trace["otherData"]["trace_start_unix_us"] > 1_600_000_000 * 10**6

    # Three concurrent asyncio fetches -> three tracks; the second round reuses them.
    fetch_tids = [e["tid"] for e in x if e["name"] == "fetch"]
    assert len(fetch_tids) == 6 and len(set(fetch_tids)) == 3 and fetch_tids[:3] == fetch_tids[3:]
    # Each decode nests in its own fetch's track; the worker thread has its own track.
    decode_tids = [e["tid"] for e in x if e["name"] == "decode"]
    assert sorted(set(decode_tids)) == sorted(set(fetch_tids))
    step_tid = next(e["tid"] for e in x if e["name"] == "step")
    bg_tid = next(e["tid"] for e in x if e["name"] == "bg")
    assert bg_tid != step_tid and bg_tid not in fetch_tids
    thread_names = {e["tid"]: e["args"]["name"] for e in events(trace, "M", name="thread_name", pid=1)}
    assert thread_names[step_tid].startswith("thread ") and "task 2" in thread_names[fetch_tids[1]]

    bad = next(e for e in x if e["name"] == "bad")
    assert bad["cname"] == "terrible" and bad["args"]["error"] == {"type": "ValueError", "message": "nope"}
    left = next(e for e in x if e["name"] == "left_open")
    assert left["args"]["incomplete"] is True and left["args"]["status"] == "incomplete"
    marker = events(trace, "i", pid=1, name="marker")
    assert len(marker) == 3 and all(e["s"] == "t" and e["tid"] == step_tid for e in marker)
    assert [e["args"]["value"] for e in events(trace, "C", pid=1, name="loss")] == [1.0, 0.5, 1 / 3]
    assert {e["args"]["value"] for e in events(trace, "C", pid=1, name="finite")} == {1}


def test_golden_perfetto_export_decodes(golden_run: Path, tmp_path: Path) -> None:
    from test_perfetto_protos import decode

    chrome = export(golden_run, "chrome", tmp_path / "t.json")
    result = export(golden_run, "perfetto", tmp_path / "t.pftrace")
    decoded = decode(result.output)
    assert (result.slices, result.instants, result.counters) == (chrome.slices, chrome.instants, chrome.counters)
    assert len(decoded["slices"]) == result.slices
    assert len(decoded["instants"]) == result.instants and len(decoded["counters"]) == result.counters
    names = list(decoded["processes"].values())
    assert len(names) == 2 and all(n.startswith(f"rank {i} (") for i, n in enumerate(names))
    seen = {s[2] for s in decoded["slices"]} | {i[2] for i in decoded["instants"]}
    assert {"step", "forward", "fetch", "decode", "bad", "left_open", "marker"} <= seen


# ---------------------------------------------------------------- fixture runs: crashes, restarts, filters


def crashed_run(tmp_path: Path) -> Path:
    r0 = Proc(rank=0)
    r0.steps(range(10))
    r0.fail(10, "forward")
    r0.shutdown()
    r1 = Proc(rank=1)
    r1.steps(range(10))
    r1.stop_inside(10, ["backward"])  # died inside: no end records at all
    r1.advance(50.0)
    r1.instant("last_words")
    r1b = Proc(rank=1, attempt=1, stamp="20240101-000100", t0=1_700_000_100.0)
    r1b.steps(range(10, 12))
    r1b.shutdown()
    write_run(tmp_path, [r0, r1, r1b], lines_per_segment=40)
    return tmp_path


def test_open_spans_extend_to_last_timestamp_and_attempts_are_processes(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "run")
    trace, result = export_json(run, tmp_path / "t.json")
    names = [e["args"]["name"] for e in events(trace, "M", name="process_name")]
    assert names == ["rank 0", "rank 1", "rank 1 (attempt 1)"]
    last_words = events(trace, "i", name="last_words")[0]
    open_spans = [e for e in events(trace, "X", pid=2) if e["args"].get("incomplete")]
    assert sorted(e["name"] for e in open_spans) == ["backward", "step"]
    assert all(e["ts"] + e["dur"] == last_words["ts"] for e in open_spans)
    assert all(e["args"]["status"] == "open" for e in open_spans)
    errors = [e for e in events(trace, "X", pid=1) if e.get("cname") == "terrible"]
    assert sorted(e["name"] for e in errors) == ["forward", "step"]


def test_rank_and_step_filters(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "run")
    trace, result = export_json(run, tmp_path / "r.json", ranks={1})
    assert result.processes == 2
    assert {e["args"]["name"] for e in events(trace, "M", name="process_name")} == {"rank 1", "rank 1 (attempt 1)"}
    trace, result = export_json(run, tmp_path / "s.json", steps=(3, 4))
    assert {e["args"].get("step") for e in events(trace, "X")} == {3, 4}
    assert result.slices == 2 * 2 * 5  # two ranks with steps 3-4, five spans per step


def test_default_output_and_structured_logs_path(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "run")
    result = export(run / schema.STRUCTURED_LOGS_DIR)
    assert result.output == run / "analysis" / "structured_trace.json"
    assert validate_chrome_trace(result.output) == []
    result = export(run, "perfetto")
    assert result.output == run / "analysis" / "structured_trace.pftrace"
    assert not list((run / "analysis").glob(".*tmp"))


def test_torn_and_garbage_lines_are_skipped(tmp_path: Path) -> None:
    p = Proc(rank=0)
    p.steps(range(3))
    write_run(tmp_path / "run", [p], torn_tail=True, garbage={3: b"\x00\xffnot json"})
    messages: list[str] = []
    from otel_train.analysis.records import Reader

    trace, result = export_json(tmp_path / "run", tmp_path / "t.json", reader=Reader(warn=messages.append))
    assert result.malformed_lines == 2 and trace["otherData"]["malformed_lines"] == 2
    assert messages and all("\n" not in m for m in messages)


def test_parallel_export_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = crashed_run(tmp_path / "run")
    p = Proc(rank=2)
    p.steps(range(4))
    write_run(run, [p], torn_tail=True, garbage={5: b"\x00\xffnot json"})
    empty = run / schema.STRUCTURED_LOGS_DIR / schema.trace_file_name("aux", 1, "20240101-000000", "zzzzzz")
    empty.write_bytes(b"not a record\n")  # sorts before rank 1's training process; its pid stays unused
    from otel_train.analysis import export as export_package
    from otel_train.analysis.records import Reader

    serial = export(run, "chrome", tmp_path / "serial.json", workers=1, reader=Reader(warn=lambda m: None))
    monkeypatch.setattr(export_package, "PARALLEL_MIN_BYTES", 0)  # a pool even for this small run
    messages: list[str] = []
    progress: list[int] = []
    pooled = export(run, "chrome", tmp_path / "pool.json", workers=2, reader=Reader(warn=messages.append,
                                                                                      progress=progress.append))
    assert (tmp_path / "serial.json").read_bytes() == (tmp_path / "pool.json").read_bytes()
    counts = lambda r: (r.slices, r.instants, r.counters, r.processes, r.malformed_lines)  # noqa: E731
    assert counts(pooled) == counts(serial) and serial.processes == 4 and serial.malformed_lines == 3
    assert len(messages) == 2 and "rank_2" in messages[1] and sum(progress) > 0
    names = {e["pid"]: e["args"]["name"] for e in events(json.loads((tmp_path / "pool.json").read_text()), "M",
                                                          name="process_name")}
    assert names == {1: "rank 0", 3: "rank 1", 4: "rank 1 (attempt 1)", 5: "rank 2"}
    assert not list(tmp_path.glob(".*.part*"))


def test_writing_in_small_chunks_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.analysis.export import chrome, perfetto

    run = crashed_run(tmp_path / "run")
    whole = {fmt: export(run, fmt, tmp_path / f"whole.{fmt}").output.read_bytes() for fmt in ("chrome", "perfetto")}
    # Writers work in chunks of slices, events and matrix rows: cut every one of them small.
    for module, name in ((chrome, "CHUNK"), (perfetto, "EVENT_CHUNK"), (perfetto, "_CHUNK_ROWS")):
        monkeypatch.setattr(module, name, 7)
    for fmt in whole:
        assert export(run, fmt, tmp_path / f"chunked.{fmt}").output.read_bytes() == whole[fmt]


# ---------------------------------------------------------------- track assignment


def span(sid: str, start: float, end: float | None, parent: str | None = None, tid: int = 1) -> Span:
    return Span(name=sid, span_id=sid, parent_span_id=parent, trace_id="t", start_ts=start, end_ts=end,
                status="ok", tid=tid, step=None)


def test_tracks_nested_concurrent_and_reused() -> None:
    spans = [
        span("root", 0, 100),
        span("a", 1, 50, "root"),  # nests under root
        span("b", 2, 60, "root"),  # concurrent sibling of a: overlaps without nesting
        span("a1", 3, 10, "a"),  # child of a, joins a's track
        span("b1", 4, 20, "b"),
        span("c", 70, 80, "root"),  # after a and b: back on root's track
        span("d", 71, 75, None),  # a root span of another task while c is open: a track of its own
        span("e", 90, 95, None),  # root is still open on track 0: the first idle track is 1
        span("f", 110, 120, None),  # everything ended: back on track 0
    ]
    tracks, made = assign_tracks(spans, [s.end_ts for s in spans])
    by = dict(zip((s.span_id for s in spans), tracks))
    assert by["root"] == by["a"] == by["a1"] == by["c"] == 0
    assert by["b"] == by["b1"] == 1
    assert by["d"] == 1 and by["e"] == 1 and by["f"] == 0
    assert [t.name for t in made] == ["thread 1", "thread 1 · task 2"]


def test_tracks_child_outliving_parent_and_other_threads() -> None:
    spans = [span("p", 0, 10), span("late", 5, 20, "p"), span("t2", 6, 8, "p", tid=2)]
    tracks, made = assign_tracks(spans, [s.end_ts for s in spans])
    assert tracks[1] != tracks[0]
    assert made[tracks[2]].tid == 2 and tracks[2] not in (tracks[0], tracks[1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30), st.integers(-1, 20), st.integers(1, 2)),
                min_size=1, max_size=40))
def test_every_track_is_strictly_nested(raw: list[tuple[int, int, int, int]]) -> None:
    raw.sort(key=lambda r: r[0])
    spans = [span(f"s{i}", float(a), float(a + d), f"s{p}" if 0 <= p < i else None, tid)
             for i, (a, d, p, tid) in enumerate(raw)]
    tracks, _ = assign_tracks(spans, [s.end_ts for s in spans])
    chrome = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "p"}}]
    chrome += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": "t"}} for t in set(tracks)]
    chrome += [{"ph": "X", "name": s.name, "ts": s.start_ts, "dur": s.end_ts - s.start_ts, "pid": 1, "tid": t}
               for s, t in zip(spans, tracks)]
    assert validate_chrome_trace({"traceEvents": chrome}) == []


def _task_spans(rng: random.Random, tids: int, ops: int, mutate: float) -> list[Span]:
    """Spans of tasks that nest properly per thread (a stack walk), some of them broken on purpose:
    a wrong parent, an end stretched past the parent's, or (when ``mutate``) zero-length spans and a
    child ending with its parent, which the sweep moves to another track."""
    out: list[Span] = []
    for tid in range(1, tids + 1):
        t, stack = 0.0, []
        for _ in range(ops):
            if stack and rng.random() < 0.5:
                t += rng.choice([0.0, 1.0, 2.5] if mutate else [1.0, 2.5])
                stack.pop().end_ts = t
                continue
            t += rng.choice([0.0, 1.0, 2.5])
            parent = stack[-1].span_id if stack else None
            if rng.random() < mutate:
                parent = rng.choice([None, "nobody", *(s.span_id for s in out)])
            s = Span(f"s{len(out)}", f"{tid}-{len(out)}", parent, "t", t, None, "ok", tid, None)
            out.append(s)
            stack.append(s)
        for s in reversed(stack):
            t += 1.0
            s.end_ts = t
        if rng.random() < mutate and out:
            victim = rng.choice(out)
            victim.end_ts = (victim.end_ts or 0.0) + rng.choice([0.5, 3.0, 50.0])
    out.sort(key=lambda s: s.start_ts)
    return out


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 40), st.sampled_from([0.0, 0.0, 0.05, 0.3]))
def test_vectorised_tracks_follow_the_sweep(seed: int, tids: int, ops: int, mutate: float) -> None:
    spans = _task_spans(random.Random(seed), tids, ops, mutate)
    ends = [s.end_ts for s in spans]
    tracks, made = assign_tracks(spans, ends)  # numpy, the sweep only for threads that need it
    swept, reference, _ = greedy_tracks([s.start_ts for s in spans], ends, [s.tid for s in spans],
                                        [s.span_id for s in spans], [s.parent_span_id for s in spans])
    assert tracks == swept
    assert [t.tid for t in made] == [t.tid for t in reference]
    if mutate == 0.0:
        assert len(made) == tids  # properly nested tasks: one track per thread


# ---------------------------------------------------------------- validator


def test_validator_catches_broken_traces(tmp_path: Path) -> None:
    bad = {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "p"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "t"}},
            {"ph": "X", "name": "outer", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"ph": "X", "name": "spill", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
            {"ph": "X", "name": "neg", "ts": 20, "dur": -1, "pid": 1, "tid": 1},
            {"ph": "X", "name": "str_ts", "ts": "30", "dur": 1, "pid": 1, "tid": 1},
            {"ph": "X", "name": "unnamed", "ts": 0, "dur": 1, "pid": 2, "tid": 7},
            {"ph": "C", "name": "loss", "ts": 1, "pid": 1, "args": {"value": "high"}},
            {"ph": "E", "ts": 3, "pid": 1, "tid": 1},
            "junk",
        ]
    }
    problems = validate_chrome_trace(bad)
    text = "\n".join(problems)
    assert "'spill' [5, 15] partially overlaps 'outer' [0, 10]" in text
    assert "dur -1" in text and "ts '30'" in text
    assert "pid 2 has no process_name" in text and "pid 2 tid 7 has no thread_name" in text
    assert "counter value value='high'" in text and "end event without a matching begin" in text
    assert "not an object" in text
    assert all("\n" not in p for p in problems)
    # Float microseconds within the epsilon are fine.
    ok = bad["traceEvents"][:2] + [
        {"ph": "X", "name": "a", "ts": 0.0, "dur": 10.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "b", "ts": 5.0, "dur": 5.0004, "pid": 1, "tid": 1},
    ]
    assert validate_chrome_trace({"traceEvents": ok}) == []
    (tmp_path / "broken.json").write_text("{not json")
    assert "not valid JSON" in validate_chrome_trace(tmp_path / "broken.json")[0]
    assert "no \"traceEvents\"" in validate_chrome_trace({})[0]


# ---------------------------------------------------------------- CLI


def test_cli_export(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "run")
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(run), "--ranks", "0,1-1", "--steps", "2-3"])
    assert res.exit_code == 0, res.output
    out = run / "analysis" / "structured_trace.json"
    assert str(out) in res.output and validate_chrome_trace(out) == []
    res = runner.invoke(app, ["export", str(run), "-f", "perfetto", "-o", str(tmp_path / "x.pftrace")])
    from test_perfetto_protos import decode

    assert res.exit_code == 0 and decode(tmp_path / "x.pftrace")["slices"]
    for args, code, needle in [
        (["export", str(tmp_path / "nowhere")], 2, "no such directory"),
        (["export", str(tmp_path)], 2, "no trace files"),
        (["export", str(run), "--ranks", "2-x"], 1, "--ranks '2-x'"),
        (["export", str(run), "--steps", "9-3"], 1, "--steps '9-3'"),
        (["export", str(run), "--format", "svg"], 1, "--format 'svg'"),
    ]:
        res = runner.invoke(app, args)
        assert res.exit_code == code, res.output
        assert needle in res.output and "Traceback" not in res.output
