"""Profiling (docs/profiling.md): the settings, the schedule, the window hook, the anomaly check, the
OOM snapshot on CPU, and the export merge. The torchrun jobs are in tests/test_profiling_torchrun.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import otel_train as ot
from otel_train import context as step_context
from otel_train.analysis.export import profiles as merge_mod
from otel_train.config import resolve_settings
from otel_train.errors import ConfigError
from otel_train.profiling import output, triggers
from otel_train.profiling.schedule import Schedule
from otel_train.profiling.window import NEVER, Windows


@pytest.mark.parametrize("overrides, fragment", [
    ({"profile_ranks": "x", "profile_steps": "1-2"}, "'profile_ranks': got 'x'"),
    ({"profile_ranks": "0", "profile_steps": "12-10"}, "'profile_steps': got '12-10'"),
    ({"profile_ranks": "0", "profile_steps": "every=2:3"}, "'profile_steps': got 'every=2:3'"),
    ({"profile_ranks": "0"}, "profile_ranks is set but profile_steps is not"),
    ({"profile_steps": "1-3"}, "profile_steps is set but profile_ranks is not"),
    ({"profile_on": "fast"}, "'profile_on': got 'fast'"),
    ({"profile_window": 0}, "'profile_window': got 0"),
    ({"profile_activities": "shapes"}, "'profile_activities': got 'shapes'"),
    ({"memory_snapshot": "always"}, "'memory_snapshot': got 'always'"),
])
def test_a_bad_profiling_value_is_one_line(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_settings(env={}, overrides=overrides)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_init_refuses_a_bad_profiling_value_before_any_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="profile_steps"):
        ot.init(save_path=tmp_path / "run", enabled=True, profile_ranks="0", profile_steps="a-b")
    assert not (tmp_path / "run").exists()


def test_schedules() -> None:
    once = Schedule("10-12")
    assert [once.window_at(s) for s in (9, 10, 12, 13)] == [None, (10, 12), (10, 12), None]
    assert (once.next_start(0), once.next_start(11), once.next_start(13)) == (10, 11, NEVER)
    every = Schedule("every=5:2")
    assert [every.window_at(s) for s in (0, 1, 5, 6, 7, 10)] == [None, None, (5, 6), (5, 6), None, (10, 11)]
    assert (every.next_start(0), every.next_start(7), every.next_start(10)) == (5, 10, 10)


class FakeProfiler:
    """Stands in for torch.profiler: what was started, stopped and exported."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text("{}")


def windows(tmp_path: Path, **kwargs: Any) -> tuple[Windows, list[tuple[str, dict]], list[FakeProfiler]]:
    instants: list[tuple[str, dict]] = []
    started: list[FakeProfiler] = []

    def start(_activities: tuple[str, ...]) -> tuple[FakeProfiler, tuple[int, int], list[str]]:
        started.append(FakeProfiler())
        return started[-1], (1000, 2000), ["cpu"]

    args = dict(rank=3, attempt=0, run_dir=str(tmp_path), schedule=None, window_steps=3, max_windows=3,
                activities=("cpu",), instant=lambda name, attrs: instants.append((name, attrs)), start_profiler=start)
    args.update(kwargs)
    return Windows(**args), instants, started


def test_a_scheduled_window_opens_at_its_first_step_and_closes_after_its_last(tmp_path: Path) -> None:
    w, instants, started = windows(tmp_path, schedule=Schedule("10-12"))
    for step in range(10):
        w.on_step(step)
    assert not started and w.next_check == 10
    for step in (10, 11, 12):
        w.on_step(step)
    assert len(started) == 1 and not started[0].stopped and not instants
    w.on_step(13)
    assert started[0].stopped and w.active is None and w.next_check == NEVER
    rel = "profiles/rank_3/scheduled.steps_10-12.pt.trace.json"
    assert instants == [("profile", {"steps": [10, 12], "reason": "scheduled", "path": rel, "window": 1,
                                     "marker_us": [1.0, 2.0], "activities": ["cpu"]})]
    assert (tmp_path / rel).is_file() and [p.name for p in (tmp_path / "profiles" / "rank_3").iterdir()] == [
        "scheduled.steps_10-12.pt.trace.json"]


def test_requests_open_one_window_at_a_time_and_at_most_max_windows(tmp_path: Path) -> None:
    w, instants, started = windows(tmp_path, max_windows=2, window_steps=2)
    w.on_step(1)
    assert w.request("straggler") and not w.request("slow_step")  # never two at once
    w.on_step(2)
    w.on_step(3)
    w.on_step(4)
    assert [a["steps"] for _, a in instants] == [[2, 3]] and instants[0][1]["reason"] == "straggler"
    assert w.request("slow_step")
    for step in (5, 6, 7):
        w.on_step(step)
    assert [a["steps"] for _, a in instants] == [[2, 3], [5, 6]]
    assert not w.request("straggler") and len(started) == 2  # max_windows reached


def test_shutdown_closes_an_open_window_at_the_current_step(tmp_path: Path) -> None:
    w, instants, _ = windows(tmp_path, schedule=Schedule("10-19"))
    step_context.set_step(10)
    w.on_step(10)
    step_context.set_step(11)
    w.close()
    step_context.reset()
    assert instants[0][1]["steps"] == [10, 11]


def span(name: str, start_ms: float, end_ms: float) -> SimpleNamespace:
    return SimpleNamespace(_name=name, _start_time=int(start_ms * 1e6), _end_time=int(end_ms * 1e6))


def job(rank_slow: bool, steps: int = 12, slow_from: int = 8, base_ms: float = 30.0, slow_ms: float = 400.0
        ) -> list[SimpleNamespace]:
    """Step spans and their collectives' spans as a DDP rank writes them: the slow rank computes longer
    and waits little; a peer computes as usual and waits for it in the all-reduce."""
    spans, t = [], 0.0
    for step in range(steps):
        extra = slow_ms if step >= slow_from else 0.0
        compute = base_ms + (extra if rank_slow else 0.0)
        wait = 1.0 + (0.0 if rank_slow else extra)
        spans.append(span("comm.all_reduce", t + compute, t + compute + wait))
        spans.append(span("step", t, t + compute + wait + 1.0))
        t += compute + wait + 2.0
    return spans


@pytest.mark.parametrize("slow, fires", [(True, True), (False, False)])
def test_straggler_fires_on_the_slow_rank_only(tmp_path: Path, slow: bool, fires: bool) -> None:
    w, _, _ = windows(tmp_path)
    check = triggers.Triggers(("straggler",), w)
    spans = job(slow)
    check.look(spans, now_ns=spans[-1]._end_time + triggers.LAG_NS)
    assert (w.pending == "straggler") is fires
    assert bool(check.fired) is fires


def test_slow_step_fires_on_every_rank_that_waits(tmp_path: Path) -> None:
    w, _, _ = windows(tmp_path)
    check = triggers.Triggers(("slow_step",), w)
    spans = job(False)
    check.look(spans, now_ns=spans[-1]._end_time + triggers.LAG_NS)
    assert w.pending == "slow_step"


def test_steps_are_judged_only_once_their_comm_spans_can_have_been_written(tmp_path: Path) -> None:
    w, _, _ = windows(tmp_path)
    check = triggers.Triggers(("straggler",), w)
    spans = job(False, steps=9)
    *before, wait, step = spans
    check.look(before, now_ns=before[-1]._end_time + triggers.LAG_NS)
    check.look([step], now_ns=step._end_time)  # the recorder has not written the step's wait yet
    check.look([wait], now_ns=step._end_time + triggers.LAG_NS - 1)
    check.look([], now_ns=step._end_time + triggers.LAG_NS)
    assert w.pending is None and check.fired == []


def profiler_hooks() -> list[Any]:
    return [f for f in step_context.step_listeners if isinstance(getattr(f, "__self__", None), Windows)]


def test_a_rank_in_profile_ranks_gets_the_hook_and_loses_it_at_shutdown(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, rank=3, world_size=4, profile_ranks="0,3", profile_steps="5-6")
    try:
        assert len(profiler_hooks()) == 1
    finally:
        ot.shutdown()
    assert not profiler_hooks()


def test_profiling_off_installs_nothing_and_on_oom_is_a_no_op_on_cpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    assert not torch.cuda.is_available()
    ot.init(save_path=tmp_path, enabled=True, memory_snapshot="on_oom")
    try:
        assert not profiler_hooks() and step_context.error_listeners == []
        with pytest.raises(RuntimeError):
            with ot.training_step(1):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    finally:
        ot.shutdown()
    assert not (tmp_path / "profiles").exists()


def test_a_rank_outside_profile_ranks_runs_no_profiler(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, rank=1, world_size=4, profile_ranks="0,3", profile_steps="1-2")
    try:
        assert not profiler_hooks()
        for step in range(4):
            with ot.training_step(step):
                pass
    finally:
        ot.shutdown()
    assert not (tmp_path / "profiles").exists()


def kineto(path: Path, base_ns: int, marker_ts: float, ops: list[tuple[str, float, float]]) -> None:
    events = [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 7, "args": {"name": "thread 7 (python)"}},
              {"ph": "X", "cat": "user_annotation", "name": output.MARKER, "pid": 7, "tid": 7, "ts": marker_ts,
               "dur": 10.0}]
    events += [{"ph": "X", "cat": "cpu_op", "name": n, "pid": 7, "tid": 7, "ts": ts, "dur": d} for n, ts, d in ops]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events}))


def test_the_merge_puts_kineto_events_on_the_trace_clock_and_refuses_paths_outside_profiles(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "structured_logs").mkdir(parents=True)
    rel = "profiles/rank_2/straggler.steps_5-7.pt.trace.json"
    # Kineto's wall clock µs = base + ts; the marker's midpoint (ts 1_000_005) goes on the records' bracket's
    # midpoint (origin + 8): the op, 95 µs after the marker's midpoint, lands at 8 + 95 µs into the trace.
    kineto(run / rel, 1_000_000_000_000, 1_000_000.0, [("aten::linear", 1_000_100.0, 50.0)])
    origin = 2_000_000_000
    doc = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 3, "tid": 0, "args": {"name": "rank 2"}},
        {"ph": "i", "name": "profile", "pid": 3, "tid": 300001, "ts": 5_000,
         "args": {"steps": [5, 7], "reason": "straggler", "path": rel, "marker_us": [origin + 1.0, origin + 15.0]}},
        {"ph": "i", "name": "profile", "pid": 1, "tid": 100001, "ts": 6_000,
         "args": {"steps": [5, 7], "reason": "scheduled", "path": "profiles/../../secret.json",
                  "marker_us": [0, 1]}},
    ], "otherData": {"trace_start_unix_us": origin}}
    out = run / "analysis" / "t.json"
    out.parent.mkdir()
    out.write_text(json.dumps(doc))
    merged = merge_mod.merge(out, run)
    assert len(merged.problems) == 1 and "refused" in merged.problems[0]
    assert [w["process"] for w in merged.windows] == ["rank 2"] and merged.events == 1
    after = json.loads(out.read_text())
    op = next(e for e in after["traceEvents"] if e["name"] == "aten::linear")
    assert op["pid"] == 3 and op["tid"] // 100_000 == 3 and op["ts"] == pytest.approx(103.0)
    assert merged.windows[0]["align_error_us"] == pytest.approx(2.0)
    assert merge_mod.merge(out, run).events == 0  # merging twice adds nothing
    assert len([e for e in json.loads(out.read_text())["traceEvents"] if e["name"] == "aten::linear"]) == 1


def test_a_straggler_finding_from_watch_asks_that_rank_through_a_file(tmp_path: Path, monkeypatch, capsys) -> None:
    import io

    from otel_train.profiling import request

    finding = {"kind": "straggler", "rank": 2, "step": 30, "phase": "forward", "message": "..."}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(finding)))
    assert request.main([str(tmp_path)]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({**finding, "kind": "hang", "rank": 1})))
    assert request.main([str(tmp_path)]) == 0  # only stragglers ask
    assert sorted(p.name for p in (tmp_path / "profiles" / "requests").iterdir()) == ["rank_2"]
    peer, _, _ = windows(tmp_path, rank=1)
    culprit, _, _ = windows(tmp_path, rank=2)
    triggers.Triggers(("straggler",), peer).look([], now_ns=10**10)
    check = triggers.Triggers(("straggler",), culprit)
    check.look([], now_ns=10**10)
    assert (peer.pending, culprit.pending) == (None, "straggler") and check.fired == [("straggler", 0.0)]
    assert not (tmp_path / "profiles" / "requests" / "rank_2").exists()  # taken once


def test_the_profile_instant_carries_the_windows_last_step(tmp_path: Path) -> None:
    """Written at the step change past the window, it is about the window: its step is the last one."""
    records: list[tuple[int | None, int | None]] = []
    w, _, _ = windows(tmp_path, schedule=Schedule("10-12"), instant=lambda name, attrs: records.append(
        (step_context.current().step, step_context.current().relative_step)))
    for step in range(5, 15):
        step_context.set_step(step)
        w.on_step(step)
    assert records == [(12, 7)] and step_context.current().step == 14
    step_context.reset()
