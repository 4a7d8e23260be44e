"""The Perfetto protobuf export, decoded with Perfetto's own protos (``perfetto_trace_pb2`` from the
``perfetto`` package), against the Chrome JSON export of the same run: the same processes, threads,
slices (name, start, duration, track, args), instants and counter samples, every track's begins and
ends properly bracketed, every sequence in time order, names interned on the sequence.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_train import schema
from otel_train.analysis.export import export
from test_export import crashed_run, run_golden

pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")

Event = tuple  # hashable rows compared as multisets


def _value(annotation: Any) -> Any:
    field = annotation.WhichOneof("value")
    return getattr(annotation, field)


def _args(event: Any) -> dict[str, Any]:
    return {a.name: _value(a) for a in event.debug_annotations}


def _freeze(args: dict[str, Any]) -> str:
    return json.dumps(args, sort_keys=True)


def decode(path: Path) -> dict[str, Any]:
    """Processes, threads, slices, instants and counter samples of a .pftrace, checking as it goes that
    each sequence is in time order and each track's ends close its innermost open slice."""
    trace = pb.Trace.FromString(path.read_bytes())
    out: dict[str, Any] = {"processes": {}, "threads": set(), "slices": [], "instants": [], "counters": []}
    pid_of: dict[int, int] = {}
    threads: dict[int, tuple[int, int]] = {}
    counter_tracks: dict[int, tuple[int, str]] = {}
    names: dict[int, dict[int, str]] = {}
    last_ts: dict[int, int] = {}
    open_slices: dict[int, list[tuple[str, int, dict]]] = {}
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            td = packet.track_descriptor
            if td.HasField("process"):
                out["processes"][td.process.pid] = td.process.process_name
                pid_of[td.uuid] = td.process.pid
            elif td.HasField("thread"):
                threads[td.uuid] = (td.thread.pid, td.thread.tid)
                out["threads"].add((td.thread.pid, td.thread.tid, td.thread.thread_name))
            else:
                assert td.HasField("counter")
                counter_tracks[td.uuid] = (pid_of[td.parent_uuid], td.name)
            continue
        seq = packet.trusted_packet_sequence_id
        assert seq and packet.timestamp >= last_ts.get(seq, 0), "a sequence's packets are in time order"
        last_ts[seq] = packet.timestamp
        if packet.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            names[seq] = {}
        names[seq].update((e.iid, e.name) for e in packet.interned_data.event_names)
        _event(packet, names[seq], threads, counter_tracks, open_slices, out)
    assert all(not stack for stack in open_slices.values()), "every begin has its end"
    return out


def _event(packet: Any, names: dict[int, str], threads: dict, counter_tracks: dict, open_slices: dict,
           out: dict[str, Any]) -> None:
    ev = packet.track_event
    assert packet.timestamp % 1000 == 0  # microseconds, like the Chrome export
    ts = packet.timestamp // 1000
    stack = open_slices.setdefault(ev.track_uuid, [])
    if ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
        if stack:
            assert ts >= stack[-1][1]
        stack.append((names[ev.name_iid], ts, _args(ev)))
    elif ev.type == pb.TrackEvent.TYPE_SLICE_END:
        name, start, args = stack.pop()
        pid, tid = threads[ev.track_uuid]
        out["slices"].append((pid, tid, name, start, ts - start, _freeze(args)))
    elif ev.type == pb.TrackEvent.TYPE_INSTANT:
        pid, tid = threads[ev.track_uuid]
        out["instants"].append((pid, tid, names[ev.name_iid], ts, _freeze(_args(ev))))
    else:
        assert ev.type == pb.TrackEvent.TYPE_COUNTER
        pid, key = counter_tracks[ev.track_uuid]
        out["counters"].append((pid, key, ts, ev.double_counter_value))


def _as_perfetto_args(args: dict[str, Any]) -> dict[str, Any]:
    """Chrome args as the debug annotations carry them: lists and dicts as JSON text."""
    return {k: json.dumps(v, separators=(",", ":")) if isinstance(v, (dict, list)) else v for k, v in args.items()}


def chrome_view(path: Path) -> dict[str, Any]:
    """The same view of a Chrome JSON export, with absolute microseconds."""
    trace = json.loads(path.read_text())
    origin = trace["otherData"]["trace_start_unix_us"]
    events = trace["traceEvents"]
    meta = {(e["name"], e["pid"], e.get("tid")): e["args"] for e in events if e["ph"] == "M"}
    processes = {}
    for (kind, pid, _), args in meta.items():
        if kind == "process_name":
            labels = meta.get(("process_labels", pid, 0), {}).get("labels")
            processes[pid] = f"{args['name']} ({labels})" if labels else args["name"]
    return {
        "processes": processes,
        "threads": {(pid, tid, a["name"]) for (kind, pid, tid), a in meta.items() if kind == "thread_name"},
        "slices": [(e["pid"], e["tid"], e["name"], e["ts"] + origin, e["dur"], _freeze(_as_perfetto_args(e["args"])))
                   for e in events if e["ph"] == "X"],
        "instants": [(e["pid"], e["tid"], e["name"], e["ts"] + origin, _freeze(_as_perfetto_args(e["args"])))
                     for e in events if e["ph"] == "i"],
        "counters": [(e["pid"], e["name"], e["ts"] + origin, float(e["args"]["value"])) for e in events if e["ph"] == "C"],
    }


def assert_same_trace(run: Path, tmp: Path, **kw: Any) -> dict[str, Any]:
    chrome_result = export(run, "chrome", tmp / "t.json", **kw)
    result = export(run, "perfetto", tmp / "t.pftrace", **kw)
    ours, theirs = decode(result.output), chrome_view(chrome_result.output)
    assert ours["processes"] == theirs["processes"]
    assert ours["threads"] == theirs["threads"]
    for key in ("slices", "instants", "counters"):
        assert Counter(ours[key]) == Counter(theirs[key]), key
    assert (result.slices, result.instants, result.counters, result.processes) == (
        len(ours["slices"]), len(ours["instants"]), len(ours["counters"]), len(ours["processes"]))
    return ours


def test_golden_run_decodes_to_the_chrome_export(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for rank in (1, 0):
        run_golden(run, rank, 2)
    ours = assert_same_trace(run, tmp_path)
    assert set(ours["processes"]) == {1, 2} and ours["processes"][1].startswith("rank 0 (")
    by_name = {s[2]: s for s in ours["slices"] if s[0] == 1}
    bad = json.loads(by_name["bad"][5])
    assert json.loads(bad["error"]) == {"type": "ValueError", "message": "nope"} and bad["status"] == "error"
    assert json.loads(by_name["left_open"][5])["incomplete"] is True
    fetch_tids = {s[1] for s in ours["slices"] if s[2] == "fetch" and s[0] == 1}
    assert len(fetch_tids) == 3  # three concurrent asyncio tasks, three tracks
    assert sorted(v for pid, key, _, v in ours["counters"] if pid == 1 and key == "loss") == [1 / 3, 0.5, 1.0]


def test_crashes_restarts_and_step_filter_decode_to_the_chrome_export(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "run")
    ours = assert_same_trace(run, tmp_path)
    assert list(ours["processes"].values())[2].startswith("rank 1 (attempt 1)")
    open_spans = [s for s in ours["slices"] if json.loads(s[5]).get("incomplete")]
    assert {s[2] for s in open_spans} >= {"step", "backward"}
    assert_same_trace(run, tmp_path, steps=(3, 4), ranks={1})


def _concurrent_run(run: Path, seed: int, spans: int) -> None:
    """One process whose spans overlap across tasks and threads: random parents, zero-length spans,
    shared timestamps, spans left open, errors."""
    rng = random.Random(seed)
    t0 = 1_700_000_000.0
    records: list[tuple[int, int, dict]] = []
    made: list[tuple[str, int, int]] = []
    for i in range(spans):
        start = rng.randrange(0, 60)
        end = start + rng.choice([0, 0, 1, 2, 5, 20, 40])
        parent = rng.choice(made)[0] if made and rng.random() < 0.6 else None
        tid = rng.choice([1, 1, 1, 2])
        sid = f"{i:016x}"
        made.append((sid, start, end))
        base = {schema.V: 1, schema.NAME: f"op{rng.randrange(4)}", schema.SPAN_ID: sid, schema.TID: tid,
                schema.STEP: rng.randrange(3)}
        records.append((start, 0, {**base, schema.TS: t0 + start / 1e3, schema.KIND: schema.SPAN_START,
                                   schema.PARENT_SPAN_ID: parent, schema.ATTRS: {"i": i}}))
        if rng.random() < 0.9:
            status = rng.choice([schema.STATUS_OK, schema.STATUS_OK, schema.STATUS_ERROR, schema.STATUS_INCOMPLETE])
            end_rec = {**base, schema.TS: t0 + end / 1e3, schema.KIND: schema.SPAN_END, schema.STATUS: status,
                       schema.DUR_MS: float(end - start)}
            if status == schema.STATUS_ERROR:
                end_rec[schema.ERROR] = {"type": "E", "message": f"m{i}"}
            records.append((end, 1, end_rec))
    records.append((60, 2, {schema.V: 1, schema.TS: t0 + 0.06, schema.KIND: schema.INSTANT, schema.NAME: "mark",
                            schema.TID: 3}))
    records.sort(key=lambda r: (r[0], r[1]))
    logs = run / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    path = logs / schema.trace_file_name("training", 0, "20240101-000000", "aaaaaa")
    path.write_text("".join(json.dumps(r) + "\n" for _, _, r in records))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), spans=st.integers(1, 40))
def test_concurrent_tasks_decode_to_the_chrome_export(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                                      spans: int) -> None:
    tmp = tmp_path_factory.mktemp("concurrent")
    _concurrent_run(tmp / "run", seed, spans)
    assert_same_trace(tmp / "run", tmp)


@pytest.mark.parametrize("chunk", [8192, 9])
def test_small_processes_written_together_are_the_bytes_each_writes_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """``perfetto.Batch`` (a 10-step window of 1,024 ranks renders 1,024 small processes) writes what
    ``render`` writes for each process in turn, byte for byte: errors, open spans, concurrent tracks,
    counters, a restart, comm flows and culprit marks. ``chunk`` 9 makes it flush between processes
    and render the larger ones alone."""
    from otel_train.analysis.export import perfetto
    from test_export_comm import hung_run

    golden = tmp_path / "golden"
    golden.mkdir()
    for rank in (1, 0):
        run_golden(golden, rank, 2)
    runs = [golden, crashed_run(tmp_path / "crashed"), hung_run(tmp_path / "hung")]
    monkeypatch.setattr(perfetto, "EVENT_CHUNK", chunk)
    together = [export(run, "perfetto", tmp_path / f"together{i}.pftrace", workers=1) for i, run in enumerate(runs)]
    monkeypatch.delattr(perfetto, "Batch")
    alone = [export(run, "perfetto", tmp_path / f"alone{i}.pftrace", workers=1) for i, run in enumerate(runs)]
    for t, a in zip(together, alone):
        assert t.output.read_bytes() == a.output.read_bytes()
        assert (t.slices, t.instants, t.counters, t.processes, t.flows) == (
            a.slices, a.instants, a.counters, a.processes, a.flows)
    assert together[2].flows > 0 and together[0].processes == 2 and together[1].processes >= 3
