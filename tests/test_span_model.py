"""Records and the span model: file discovery, rotation order, bad lines, pairing, attempts, step filter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_train import schema
from otel_train.analysis.spans import STATUS_OPEN, assign_attempts, iter_processes
from otel_train.analysis.records import (
    ProcessFiles,
    Reader,
    TraceReadError,
    find_process_files,
)
from analysis_fixtures import Proc, write_run


def _run(tmp_path: Path, n_steps: int = 5, **kw: object) -> tuple[Path, list[Proc]]:
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(n_steps))
        p.shutdown()
    write_run(tmp_path, procs, **kw)  # type: ignore[arg-type]
    return tmp_path, procs


def test_finds_files_from_run_dir_and_logs_dir(tmp_path: Path) -> None:
    run, procs = _run(tmp_path)
    (run / schema.STRUCTURED_LOGS_DIR / "notes.txt").write_text("not a trace")
    for path in (run, run / schema.STRUCTURED_LOGS_DIR):
        pfs = find_process_files(path)
        assert [(pf.rank, pf.source) for pf in pfs] == [(0, "training"), (1, "training")]
        assert pfs[0].instance == f"{procs[0].stamp}-{procs[0].rand}"


@pytest.mark.parametrize("kind", ["empty", "missing", "file"])
def test_no_trace_files_is_a_one_line_error(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "run"
    if kind == "empty":
        (target / schema.STRUCTURED_LOGS_DIR).mkdir(parents=True)
    elif kind == "file":
        target.write_text("x")
    with pytest.raises(TraceReadError) as info:
        find_process_files(target)
    message = str(info.value)
    assert "\n" not in message and str(target) in message


def test_rotated_segments_read_oldest_first_and_complete(tmp_path: Path) -> None:
    run, procs = _run(tmp_path, n_steps=20, lines_per_segment=17)
    pf = find_process_files(run)[0]
    assert len(pf.paths) > 3
    assert pf.paths[-1].name.endswith(schema.FILE_SUFFIX)
    assert [p.name.rsplit(".", 1)[-1] for p in pf.paths[:2]] == [str(len(pf.paths) - 1), str(len(pf.paths) - 2)]
    reader = Reader(warn=lambda m: pytest.fail(m))
    seqs = [r[schema.SEQ] for r in reader.records(pf)]
    assert seqs == list(range(1, len(procs[0].lines) + 1))
    assert reader.malformed_lines == 0


def test_torn_garbage_and_binary_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    garbage = {3: b"{not json", 5: b"\x00\xff\xfe binary \x80", 7: b"[1, 2]", 9: b'{"v": 1, "kind": "x"}'}
    run, procs = _run(tmp_path, garbage=garbage, torn_tail=True)
    warnings: list[str] = []
    reader = Reader(warn=warnings.append)
    pfs = find_process_files(run)
    records = [r for pf in pfs for r in reader.records(pf)]
    # per file: 4 garbage lines + the torn last line
    assert reader.malformed_lines == 10
    assert len(records) == sum(len(p.lines) for p in procs) - 2
    assert len(warnings) == 2  # once per file
    assert f"{pfs[0].paths[0]}:4:" in warnings[0]  # garbage inserted before index 3 = line 4


def test_unknown_fields_are_kept(tmp_path: Path) -> None:
    logs = tmp_path / schema.STRUCTURED_LOGS_DIR
    logs.mkdir()
    rec = {"v": 1, "ts": 1.5, "kind": "instant", "name": "x", "future_field": {"a": [1]}}
    (logs / schema.trace_file_name("training", 0, "20240101-000000", "abcdef")).write_text(json.dumps(rec) + "\n")
    (only,) = Reader().records(find_process_files(tmp_path)[0])
    assert only["future_field"] == {"a": [1]}


def test_model_pairs_spans_and_marks_unclosed(tmp_path: Path) -> None:
    alive, killed = Proc(rank=0), Proc(rank=1)
    alive.steps(range(3))
    alive.fail(3, "forward", "ValueError", "bad batch")
    alive.stop_inside(4, ["data_fetch"])
    alive.shutdown()
    killed.steps(range(4))
    killed.stop_inside(4, ["forward"])  # SIGKILL: no end records, no process_end
    write_run(tmp_path, [alive, killed])
    a, k = list(iter_processes(tmp_path, Reader()))
    assert (a.rank, k.rank) == (0, 1)
    assert a.ended_cleanly and not k.ended_cleanly
    assert [s.name for s in a.spans if s.status == schema.STATUS_INCOMPLETE] == ["step", "data_fetch"]
    assert [s.name for s in k.spans if s.status == STATUS_OPEN] == ["step", "forward"]
    assert all(s.end_ts is None for s in k.spans if s.status == STATUS_OPEN)
    errors = [s for s in a.spans if s.status == schema.STATUS_ERROR]
    assert {s.name for s in errors} == {"step", "forward"}
    assert errors[1].error == {"type": "ValueError", "message": "bad batch"}
    fwd = next(s for s in a.spans if s.name == "forward" and s.step == 0)
    assert fwd.dur_ms == pytest.approx(20.0, abs=1e-3)
    step0 = next(s for s in a.spans if s.name == "step" and s.step == 0)
    assert fwd.parent_span_id == step0.span_id
    assert a.host == "node0" and a.world_size == 2 and a.pid == alive.pid


def test_an_op_its_caller_outlived_is_not_where_the_rank_stopped(tmp_path: Path) -> None:
    # Seen in CI (tests/test_grad_accum.py): the last step's all_reduce, read from the Flight Recorder
    # buffer, was not marked done by gloo when the process shut down cleanly; shutdown ended it
    # incomplete after its backward had ended, and summarize called a finished run a hang.
    done, stuck, killed = Proc(rank=0), Proc(rank=1), Proc(rank=2)
    for p in (done, stuck, killed):
        p.steps(range(3))
        p.set_step(3)
        p.start("step")
        p.start("backward")
        p.start("comm.all_reduce", **{"comm.group": "0", "comm.seq": 4, "comm.source": "flight_recorder"})
        p.advance(2.0)
    done._stack[-1], done._stack[-2] = done._stack[-2], done._stack[-1]
    done.end()  # backward returned: the op was done
    done.end(schema.STATUS_INCOMPLETE)  # ... but shutdown found it unfinished
    done.end()
    for _ in range(3):  # the other rank stopped inside the op: every span ended incomplete, innermost first
        stuck.end(schema.STATUS_INCOMPLETE)
    # tests/test_stats.py saw this one: gloo failed the op when its peer went away, backward and step
    # raised, and the rank was SIGKILLed before anything ended the op's span.
    killed._stack[-1], killed._stack[-2] = killed._stack[-2], killed._stack[-1]
    killed.end(schema.STATUS_ERROR, {"type": "RuntimeError", "message": "Connection closed by peer"})
    killed._stack[-1], killed._stack[-2] = killed._stack[-2], killed._stack[-1]
    killed.end(schema.STATUS_ERROR, {"type": "RuntimeError", "message": "Connection closed by peer"})
    for p in (done, stuck):
        p.shutdown()
    write_run(tmp_path, [done, stuck, killed])
    d, s, k = list(iter_processes(tmp_path, Reader()))
    assert not k.ended_cleanly and [u.name for u in k.unclosed] == []
    assert [o.end for o in k.comm_ops()[0] if o.op == "all_reduce"] == [None]  # the comm graph still has it open
    assert [u.name for u in d.unclosed] == [] and d.phases["comm.all_reduce"].durs[-1] == pytest.approx(2.0)
    assert sorted(u.name for u in s.unclosed) == ["backward", "comm.all_reduce", "step"]


def test_span_whose_start_rotated_away_is_rebuilt(tmp_path: Path) -> None:
    p = Proc(rank=0)
    p.steps(range(4))
    p.shutdown()
    write_run(tmp_path, [p], lines_per_segment=10)
    logs = tmp_path / schema.STRUCTURED_LOGS_DIR
    oldest = max(logs.iterdir(), key=lambda f: int(f.name.rsplit(".", 1)[-1]) if f.name[-1].isdigit() else 0)
    oldest.unlink()  # backup_count exceeded: the oldest segment is gone
    (trace,) = iter_processes(tmp_path, Reader())
    step0 = next(s for s in trace.spans if s.name == "step" and s.step == 0)
    assert step0.status == schema.STATUS_OK and step0.dur_ms == pytest.approx(75.0, abs=1e-3)


def test_attempts_from_records_and_restart_numbering(tmp_path: Path) -> None:
    first = Proc(rank=0, attempt=0, stamp="20240101-000000")
    second = Proc(rank=0, attempt=1, stamp="20240101-001000", t0=1_700_000_600.0)
    for p in (first, second):
        p.steps(range(2))
        p.shutdown()
    write_run(tmp_path, [second, first])
    traces = list(iter_processes(tmp_path, Reader()))
    assert [(t.rank, t.attempt, t.pid) for t in traces] == [(0, 0, first.pid), (0, 1, second.pid)]

    # Two instances that both claim attempt 0 (a restart the launcher did not number): by start time.
    logs = tmp_path / schema.STRUCTURED_LOGS_DIR
    second_path = logs / second.file_name
    second_path.write_text(second_path.read_text().replace('"attempt":1', '"attempt":0'))
    by_pf = assign_attempts(find_process_files(tmp_path))
    assert sorted((pf.instance[:15], a) for pf, a in by_pf.items()) == [
        ("20240101-000000", 0),
        ("20240101-001000", 1),
    ]


def test_rank_and_step_filters(tmp_path: Path) -> None:
    _run(tmp_path, n_steps=10)
    (trace,) = iter_processes(tmp_path, Reader(), ranks={1}, steps=(3, 4))
    assert trace.rank == 1
    assert {s.step for s in trace.spans} == {3, 4}
    assert len([s for s in trace.spans if s.name == "step"]) == 2


_line = st.one_of(
    st.binary(max_size=60),
    st.builds(
        lambda ts, kind: json.dumps({"v": 1, "ts": ts, "kind": kind, "name": "x", "span_id": "ab"}).encode(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([*schema.KINDS, "other"]),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, max_size=30), cut=st.integers(min_value=0, max_value=400))
def test_reader_never_raises_on_random_or_truncated_input(tmp_path: Path, lines: list[bytes], cut: int) -> None:
    path = tmp_path / schema.trace_file_name("training", 0, "20240101-000000", "fuzz00")
    data = b"\n".join(lines)
    data = data[: len(data) - cut] if cut < len(data) else data
    path.write_bytes(data)
    pf = ProcessFiles("training", 0, "20240101-000000-fuzz00", (path,))
    reader = Reader(warn=lambda m: None)
    good = list(reader.records(pf))
    nonblank = [ln for ln in data.split(b"\n") if ln.strip()]
    assert len(good) + reader.malformed_lines == len(nonblank)
    assert all(isinstance(r, dict) and schema.KIND in r for r in good)
    list(iter_processes(tmp_path, Reader(warn=lambda m: None)))  # never raises either
