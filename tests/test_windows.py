"""Step windows (``--steps A-B``): what a window read gives equals the same steps of a full read.

A window read bisects each file on its steps and reads only the window, the head, the tail and the
ends of spans that enclose the window (otel_train/analysis/reading/window.py); these tests cut a full
read to the same window (``spans.restrict``) and compare: phases, findings, stats rows, whatif, the
exported slices, across rotated segments, with spans open across the window's edges.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis_fixtures import Proc, write_run
from otel_train import schema
from otel_train.analysis.reading import window
from otel_train.analysis.records import Reader, find_process_files
from otel_train.analysis.spans import Run, iter_processes, keep_steps, load_run, read_process, restrict
from otel_train.analysis.stats import compute_stats
from otel_train.analysis.summary import summarize_run
from otel_train.analysis.whatif import whatif
from otel_train.cli import app
from otel_train.phases import STEP

STEPS = 300


def _procs(n_steps: int = STEPS, *, slow_rank: int | None = 1, umbrella: bool = True) -> list[Proc]:
    """Four data-parallel ranks: backward ends for everyone 40 ms after the last one arrives (what-if's
    model; a run whose ranks drift apart is left out of it), ``slow_rank``'s data_fetch 4 ms slower on
    even steps."""
    procs = [Proc(rank=rank, world_size=4) for rank in range(4)]
    if umbrella:
        for p in procs:
            p.start("train")  # before the first step: no step, encloses every window
    for s in range(n_steps):
        for p in procs:
            fetch = 9.0 if p.rank == slow_rank and s % 2 == 0 else 5.0
            p.set_step(s)
            p.start(STEP)
            for name, ms in (("data_fetch", fetch), ("forward", 20.0)):
                p.advance(1.0)
                p.start(name)
                p.advance(ms)
                p.end()
            p.advance(1.0)
            p.start("backward")
        last = max(p.now_ms for p in procs)
        for p in procs:
            p.now_ms = last + 40.0
            p.end()
            p.advance(1.0)
            p.start("optimizer")
            p.advance(5.0)
            p.end()
            p.advance(1.0)
            p.end()
    for p in procs:
        if umbrella:
            p.advance(2.0)
            p.end()  # train ends after the last step: found by the raw scan back from the tail
        p.shutdown()
    return procs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("windows")
    write_run(d, _procs(), lines_per_segment=700)  # about 8 steps a segment: dozens of segments
    return d


def _cut(run: Run, lo: int, hi: int) -> Run:
    for state in run.processes:
        restrict(state, lo, hi)
    return run


def _phases(run: Run) -> list[tuple]:
    return [(d.rank, name, list(s.steps), list(s.durs), list(s.ends))
            for d in run.processes for name, s in sorted(d.phases.items())]


@pytest.mark.parametrize("lo,hi", [(0, 9), (100, 109), (145, 160), (290, 299), (0, STEPS - 1), (5000, 5010)])
def test_window_read_equals_the_same_steps_of_a_full_read(run_dir: Path, lo: int, hi: int) -> None:
    win = load_run(run_dir, steps=(lo, hi), cache=False)
    full = _cut(load_run(run_dir, cache=False), lo, hi)
    assert _phases(win) == _phases(full)
    if lo < STEPS:
        assert _phases(win), "the window holds steps"
    for a, b in zip(win.processes, full.processes):
        assert (a.ended_cleanly, a.final_step, a.last_event, a.errors) == (b.ended_cleanly, b.final_step,
                                                                           b.last_event, b.errors)
        assert [(u.name, u.step, u.status) for u in a.unclosed] == [(u.name, u.step, u.status) for u in b.unclosed]
    sa, sb = summarize_run(win), summarize_run(full)
    assert sa["phases"] == sb["phases"]
    assert sa["findings"] == sb["findings"]
    assert compute_stats(win)["steps"] == compute_stats(full)["steps"]


def test_window_finds_the_straggler_and_whatif_agrees(run_dir: Path) -> None:
    lo, hi = 100, 199
    win = load_run(run_dir, steps=(lo, hi), cache=False)
    full = _cut(load_run(run_dir, cache=False), lo, hi)
    answer = whatif(win)
    assert answer["steps"] == hi - lo and not answer["unsynchronized"] and answer["by_rank"][0]["rank"] == 1
    assert json.dumps(answer, sort_keys=True) == json.dumps(whatif(full), sort_keys=True)  # NaN == NaN
    found = [f for f in summarize_run(win)["findings"] if f["kind"] == "straggler"]
    assert [f["rank"] for f in found] == [1], found


def test_window_reads_a_fraction_of_the_bytes(run_dir: Path) -> None:
    for pf in find_process_files(run_dir):
        plan = window.plan(pf, 150, 152)
        assert plan is not None
        assert plan.nbytes < pf.size / 4, (plan.nbytes, pf.size)
        assert any(r.gap for r in plan.ranges)


def _spans(states: list) -> list[tuple]:
    return sorted((d.rank, s.name, s.span_id, s.step, s.start_ts, s.end_ts, s.status, s.parent_span_id)
                  for d in states for s in d.spans)


@pytest.mark.parametrize("lo,hi", [(148, 152), (0, 3), (296, 299)])
def test_exported_slices_equal_the_full_read(run_dir: Path, lo: int, hi: int) -> None:
    win = list(iter_processes(run_dir, Reader(), steps=(lo, hi)))
    full = []
    for pf in find_process_files(run_dir):
        state = read_process(pf, 0, Reader(), keep=True)
        keep_steps(state, lo, hi)
        full.append(state)
    got, want = _spans(win), _spans(full)
    assert got == want
    umbrella = [s for s in got if s[1] == "train"]
    assert len(umbrella) == 4 and all(s[6] == "ok" and s[5] is not None for s in umbrella), umbrella
    assert any(s[1] == "step" and s[3] == lo for s in got)


def test_a_span_crossing_the_window_start_is_not_moved_into_it(tmp_path: Path) -> None:
    p = Proc(rank=0, world_size=1)
    for s in range(40):
        p.step(s)
    p.set_step(40)
    p.start("step")
    p.start("checkpoint")  # started in step 40, ended in step 41: its step is 40
    p.advance(5.0)
    p.set_step(41)
    p.end()
    p.end()
    for s in range(42, 80):
        p.step(s)
    p.shutdown()
    write_run(tmp_path, [p], lines_per_segment=50)
    for lo, hi in ((41, 45), (40, 41)):
        win = load_run(tmp_path, steps=(lo, hi), cache=False)
        full = _cut(load_run(tmp_path, cache=False), lo, hi)
        assert _phases(win) == _phases(full)
        assert ("checkpoint" in win.processes[0].phases) == (lo <= 40)


def test_steps_that_repeat_per_epoch_are_read_whole(tmp_path: Path) -> None:
    p = Proc(rank=0, world_size=1)
    for epoch in range(3):
        for s in range(50):
            p.step(s)
    p.shutdown()
    write_run(tmp_path, [p], lines_per_segment=200)
    pf = find_process_files(tmp_path)[0]
    assert window.plan(pf, 10, 12) is None
    win = load_run(tmp_path, steps=(10, 12), cache=False)
    full = _cut(load_run(tmp_path, cache=False), 10, 12)
    assert _phases(win) == _phases(full)


def _epoch_run(tmp_path: Path, *, restart: bool) -> Path:
    """One process, 3 epochs of 50 steps, every record carrying its epoch: steps 0-49 again each
    epoch (``restart``) or 0-149 (a global step, the README's loop)."""
    p = Proc(rank=0, world_size=1)
    marks = []
    for epoch in range(3):
        for s in range(50):
            p.step(s if restart else 50 * epoch + s)
        marks.append(len(p.lines))
    p.shutdown()
    epoch_of = lambda i: next((e for e, m in enumerate(marks) if i < m), 2)  # noqa: E731
    lines = []
    for i, line in enumerate(p.lines):
        rec = json.loads(line)
        if schema.EPOCH in rec:
            rec[schema.EPOCH] = epoch_of(i)
        lines.append(json.dumps(rec, separators=(",", ":")))
    p.lines = lines
    write_run(tmp_path, [p], lines_per_segment=200)
    return tmp_path


@pytest.mark.parametrize("restart", [True, False])
def test_several_epochs_are_windowed_unless_their_steps_restart(tmp_path: Path, restart: bool) -> None:
    run = _epoch_run(tmp_path, restart=restart)
    pf = find_process_files(run)[0]
    assert (window.plan(pf, 60, 62) is None) == restart  # a global step across epochs is bisected
    win = load_run(run, steps=(60, 62), cache=False)
    full = _cut(load_run(run, cache=False), 60, 62)
    assert _phases(win) == _phases(full) and _phases(full)


def test_torn_lines_in_the_window_are_warned_and_counted(tmp_path: Path) -> None:
    procs = _procs(60, umbrella=False)
    write_run(tmp_path, procs, garbage={300: b'{"v":1,"ts":1700000000.1,"kind":"span_'})
    warnings: list[str] = []
    win = load_run(tmp_path, steps=(28, 31), cache=False, warn=warnings.append)
    assert win.malformed_lines == 4 and len(warnings) == 4, warnings


def test_cli_steps_on_every_reading_command(run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    for args in (["summarize", "--json"], ["stats", "--json"], ["whatif", "--json"]):
        res = runner.invoke(app, [args[0], str(run_dir), *args[1:], "--steps", "100-109", "--no-cache"])
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["diff", str(run_dir), str(run_dir), "--steps", "100-109", "--json"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["summarize", str(run_dir), "--steps", "9-3"])
    assert res.exit_code == 2 and "--steps" in res.output and "Traceback" not in res.output


def test_an_enclosing_span_that_ends_far_from_the_tail_is_found(tmp_path: Path) -> None:
    p = Proc(rank=0, world_size=1)
    p.start("train")  # no step: encloses steps 0..199, ends far before the tail
    p.steps(range(200))
    p.end()
    p.steps(range(200, 400))
    p.shutdown()
    write_run(tmp_path, [p], lines_per_segment=900)
    pf = find_process_files(tmp_path)[0]
    plan = window.plan(pf, 100, 104)
    assert plan is not None and len(window.find_ends(pf, plan, [p.lines[1].split('"span_id":"')[1][:16]])) == 1
    win = list(iter_processes(tmp_path, Reader(), steps=(100, 104)))
    full = read_process(pf, 0, Reader(), keep=True)
    keep_steps(full, 100, 104)
    assert _spans(win) == _spans([full])
    train = [s for s in _spans(win) if s[1] == "train"]
    assert len(train) == 1 and train[0][6] == "ok" and train[0][5] is not None


# ---------------------------------------------------------------------------------------------
# export --steps: the window's slices, flows and marks equal the same steps of a full export


def _comm_procs(n_steps: int = 120) -> list[Proc]:
    procs = []
    for rank in range(4):
        p = Proc(rank=rank, world_size=4)
        p.instant(schema.INSTANT_COMM_GROUP, group="0", desc="default_pg", ranks=[0, 1, 2, 3])
        p.start("train")
        for s in range(n_steps):
            p.set_step(s)
            p.start("step")
            p.advance(1.0)
            p.start("forward")
            p.advance(20.0 + (7.0 if rank == 2 and s % 3 == 0 else 0.0))
            p.end()
            p.start("backward")
            p.advance(10.0)
            p.start("comm.all_reduce", **{schema.ATTR_COMM_GROUP: "0", schema.ATTR_COMM_SEQ: s,
                                          schema.ATTR_COMM_BYTES: 4096, schema.ATTR_COMM_DTYPE: "float32"})
            p.advance(5.0 + rank * 0.25)
            p.end()
            p.end()
            p.scalar({"loss": 1.0 / (s + 1)})
            p.advance(1.0)
            p.end()
        p.end()
        p.shutdown()
        procs.append(p)
    return procs


@pytest.fixture(scope="module")
def comm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("comm-windows")
    write_run(d, _comm_procs(), lines_per_segment=500)
    return d


def _slices(trace: dict, lo: int, hi: int | None = None) -> dict[str, tuple]:
    """Span id -> (name, ts, dur, pid, tid, args without the flow id) of the X events (of steps lo..hi)."""
    out = {}
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        step = e["args"].get("step")
        if hi is not None and step is not None and not lo <= step <= hi:
            continue
        args = {k: v for k, v in e["args"].items() if k != "bind_id"}
        out[e["args"]["span_id"]] = (e["name"], e["ts"], e["dur"], e["pid"], e["tid"], json.dumps(args, sort_keys=True),
                                     "bind_id" in e or "bind_id" in e["args"])
    return out


def _flow_groups(trace: dict, ids: set[str]) -> set[frozenset[str]]:
    groups: dict[str, set[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["args"]["span_id"] in ids and "bind_id" in e:
            groups.setdefault(e["bind_id"], set()).add(e["args"]["span_id"])
    return {frozenset(g) for g in groups.values()}


def _chrome(run: Path, out: Path, **kw: object) -> dict:
    from otel_train.analysis.export import export

    export(run, "chrome", out, **kw)
    return json.loads(out.read_text())


@pytest.mark.parametrize("lo,hi", [(50, 59), (0, 2), (117, 119)])
def test_an_exported_window_equals_the_same_steps_of_a_full_export(comm_run: Path, tmp_path: Path,
                                                                   lo: int, hi: int) -> None:
    full = _chrome(comm_run, tmp_path / "full.json", cache=False)
    win = _chrome(comm_run, tmp_path / "win.json", steps=(lo, hi), cache=False)
    got, want = _slices(win, lo), _slices(full, lo, hi)
    assert got == want
    assert sum(1 for s in got.values() if s[0] == "comm.all_reduce") == 4 * (hi - lo + 1)
    assert sum(1 for s in got.values() if s[0] == "train") == 4  # the enclosing span, whole
    flows = _flow_groups(win, set(got))
    assert flows == _flow_groups(full, set(got)) and len(flows) == hi - lo + 1
    counters = [e for e in win["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == 4 * (hi - lo + 1)


def test_an_exported_window_reads_the_window_only(comm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    import otel_train.analysis.export as exp

    def no_scan(*_a: object, **_k: object) -> None:
        raise AssertionError("a window's comm plan scans the whole run")

    monkeypatch.setattr(exp, "scan_comm", no_scan)
    read: list[int] = []
    exp.export(comm_run, "perfetto", tmp_path / "w.pftrace", steps=(60, 62), reader=Reader(progress=read.append),
               cache=False)
    pfs = find_process_files(comm_run)
    planned = sum(window.plan(pf, 60, 62).nbytes for pf in pfs)  # type: ignore[union-attr]
    assert sum(read) == planned < sum(pf.size for pf in pfs) / 3  # each window read once


def _head_cases(tmp_path: Path) -> list[Path]:
    """Runs whose identity fields sit where a quick look at a file's first 8 KiB could miss them."""
    cases = []
    late = tmp_path / "late"  # job_id first written on the 60th line (past 8 KiB), within 64 KiB
    procs = [Proc(rank=0, world_size=1)]
    procs[0].steps(range(6))
    write_run(late, procs)
    path = next((late / schema.STRUCTURED_LOGS_DIR).iterdir())
    lines = path.read_text().splitlines()
    lines[60] = lines[60][:-1] + ',"job_id":"slurm-42"}'
    path.write_text("\n".join(lines) + "\n")
    cases.append(late)
    rotated = tmp_path / "rotated"  # small segments: the full read goes on into the next one
    procs = [Proc(rank=0, world_size=1)]
    procs[0].steps(range(6))
    write_run(rotated, procs, lines_per_segment=8)
    cases.append(rotated)
    torn = tmp_path / "torn"  # a bad line early: decided by the full read's line-by-line rule
    procs = [Proc(rank=0, world_size=1)]
    procs[0].steps(range(6))
    write_run(torn, procs, garbage={0: b'{"v":1,"ts":'})
    cases.append(torn)
    return cases


def test_the_quick_head_equals_the_full_heads_answer(tmp_path: Path) -> None:
    """reading.whole.head decodes 8 KiB first; whatever the file, its answer is the 64 KiB read's."""
    from otel_train.analysis.reading import whole
    from otel_train.analysis.reading.types import Head

    for run in _head_cases(tmp_path):
        for pf in find_process_files(run, warn=lambda _m: None):
            full = whole._first_values(whole.peek(pf, Head, limit=256))
            assert whole.head(pf) == full, run.name
    late = find_process_files(tmp_path / "late")[0]
    assert whole._quick_head(late) is None and whole.head(late).job_id == "slurm-42"  # type: ignore[union-attr]


def test_peek_decodes_only_the_lines_it_returns_and_returns_the_first_readable_ones(tmp_path: Path) -> None:
    """reading.whole.peek decodes a segment's first lines still wanted, not its whole 64 KiB; what it
    returns is still the first ``limit`` readable lines, one by one, across segments and bad lines."""
    from otel_train.analysis.reading import whole
    from otel_train.analysis.reading.discovery import open_regular
    from otel_train.analysis.reading.types import RECORD_DECODER

    def first_readable(pf, limit: int) -> list:
        out = []
        for path in pf.paths:
            with open_regular(path) as f:
                for line in f.read(64 * 1024).split(b"\n"):
                    try:
                        out.append(RECORD_DECODER.decode(line))
                    except Exception:  # noqa: BLE001 - the reference skips what does not decode
                        continue
        return out[:limit]

    for n, (garbage, per_segment) in enumerate([(None, None), ({3: b"{torn"}, None), ({70: b"\x00 bad"}, 40),
                                                ({0: b"{", 1: b"nope"}, 7)]):
        p = Proc(rank=0, world_size=1)
        p.steps(range(40))
        write_run(tmp_path / str(n), [p], garbage=garbage, lines_per_segment=per_segment, torn_tail=n == 3)
        for pf in find_process_files(tmp_path / str(n), warn=lambda _m: None):
            for limit in (1, 5, 64, 150, 1000):
                assert whole.peek(pf, limit=limit) == first_readable(pf, limit), (n, limit)


@pytest.mark.parametrize("fmt", ["chrome", "perfetto"])
def test_a_window_planned_and_read_by_a_pool_exports_the_same_bytes(comm_run: Path, tmp_path: Path, fmt: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of many processes (export.WINDOW_POOL_MIN: 1,024 ranks) is planned and read by a pool:
    the file, the counts, the bytes read (progress) and a torn line's warning and count are what the
    reads here give. The pool is counted, so the test fails if it was not used."""
    import otel_train.analysis.export as exp

    torn = tmp_path / "torn"
    write_run(torn, _comm_procs(60), garbage={300: b'{"v":1,"ts":1700000000.1,"kind":"span_'})
    serial = []
    for run in (comm_run, torn):
        read, warnings = [], []
        got = exp.export(run, fmt, tmp_path / f"serial-{run.name}", steps=(28, 33), workers=1, cache=False,
                         reader=Reader(warn=warnings.append, progress=read.append))
        serial.append((got.output.read_bytes(), (got.slices, got.instants, got.counters, got.processes, got.flows), got.malformed_lines, sum(read), warnings))
    monkeypatch.setattr(exp, "WINDOW_POOL_MIN", 2)
    pools: list[int] = []

    class Counted(exp.ProcessPoolExecutor):  # type: ignore[misc]
        def __init__(self, workers: int, **kwargs: object) -> None:
            pools.append(workers)
            super().__init__(workers, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exp, "ProcessPoolExecutor", Counted)
    for run, want in zip((comm_run, torn), serial):
        read, warnings = [], []
        got = exp.export(run, fmt, tmp_path / f"pooled-{run.name}", steps=(28, 33), workers=2, cache=False,
                         reader=Reader(warn=warnings.append, progress=read.append))
        assert (got.output.read_bytes(), (got.slices, got.instants, got.counters, got.processes, got.flows), got.malformed_lines, sum(read), warnings) == want
    # the window's pools (a forked copy that renders half the processes, one worker, comes on top when
    # this process may fork: the next test)
    assert pools.count(2) == 2 and serial[1][2] == 4 and len(serial[1][4]) == 4 and serial[0][3] > 0  # a torn line a rank


@pytest.mark.parametrize("fmt", ["chrome", "perfetto"])
def test_a_window_of_many_processes_rendered_in_two_halves_is_the_same_file(comm_run: Path, tmp_path: Path, fmt: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of many processes read already (export.WINDOW_POOL_MIN) is rendered half here and half by
    a forked copy, appended in order: the file and counts of one process rendering them all, also when
    the copy fails (its half is rendered here). The copy is counted, so the test fails without one."""
    import concurrent.futures
    import multiprocessing
    import os

    import otel_train.analysis.export as exp
    from otel_train.analysis import pools

    def export(name: str, workers: int) -> tuple:
        got = exp.export(comm_run, fmt, tmp_path / name, steps=(28, 33), workers=workers, cache=False)
        return got.output.read_bytes(), (got.slices, got.instants, got.counters, got.processes, got.flows)

    alone = export("alone", 1)
    monkeypatch.setattr(exp, "WINDOW_POOL_MIN", 2)
    # Forked whatever threads an earlier test left behind (the library itself forks only with one thread).
    monkeypatch.setattr(pools, "pool_context", lambda: multiprocessing.get_context("fork"))
    copies: list[int] = []

    class Counted(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, workers: int, **kwargs: object) -> None:
            copies.append(workers)
            super().__init__(workers, **kwargs)  # type: ignore[arg-type]

    # pools imports the pool where it forks the copy (the window's read pool is export's own): patched at its source.
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Counted)
    assert export("halves", 2) == alone and copies == [1]

    here, into_bytes = os.getpid(), exp._into_bytes

    def broken(*args: object) -> object:
        if os.getpid() != here:
            raise MemoryError("the copy was killed")
        return into_bytes(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(exp, "_into_bytes", broken)
    assert export("fallback", 2) == alone and copies == [1, 1]
