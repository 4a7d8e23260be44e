"""The watchdog thread in a real traced process: heartbeat cadence, stall thresholds with and without
history, stacks that name the stuck function, doubling and the cap, fork children, off switch."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import otel_train as ot
from otel_train import record_clock, _report, schema
from otel_train.stall import MAX_STALLS_PER_SPAN
from otel_train.watchdog import DurationSketch, Watchdog


def _records(save_path: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted((save_path / schema.STRUCTURED_LOGS_DIR).iterdir()):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _named(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == schema.INSTANT and r["name"] == name]


def stuck_until_records(more: int, cap_s: float = 30.0) -> None:
    """Stay inside the open span until the watchdog made ``more`` records (its stalls: nothing else
    writes meanwhile), however late a loaded machine runs it; past ``cap_s`` the test's asserts fail."""
    from otel_train import runtime

    jsonl = runtime._active.jsonl  # type: ignore[union-attr]
    want, deadline = jsonl.records_written + more, time.monotonic() + cap_s
    while jsonl.records_written < want and time.monotonic() < deadline:
        time.sleep(0.02)


def test_heartbeats_only_while_quiet_at_the_configured_cadence(tmp_path: Path) -> None:
    """A heartbeat only after ``heartbeat_s`` without a record, and then one every ``heartbeat_s``.
    Judged on the records' own times, not on fixed sleeps: a loaded machine may hold the busy loop
    (then a beat in its gap is right) or the watchdog's look (then a beat is late, not missing)."""
    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0.4, stall_min_s=60, digest_s=0)
    busy_until = time.monotonic() + 1.2
    while time.monotonic() < busy_until:  # a record every 50 ms: never quiet for 0.4 s unless held
        with ot.log_trace_span("data_fetch"):
            time.sleep(0.05)
    quiet_from = time.time()
    with ot.log_trace_span("step"):
        stuck_until_records(5)  # five heartbeats: nothing else writes while the step is open
    ot.shutdown()
    records = sorted(_records(tmp_path), key=lambda r: r["ts"])
    beats = _named(records, schema.INSTANT_HEARTBEAT)
    quiet = [b for b in beats if b["ts"] >= quiet_from]
    assert len(quiet) >= 5, [r["name"] for r in records[-10:]]
    before = {id(b): max(r["ts"] for r in records if r["ts"] < b["ts"]) for b in beats}
    tick = 0.1  # heartbeat_s / 4
    assert all(b["ts"] - before[id(b)] >= 0.4 - 0.005 for b in beats), [b["ts"] - before[id(b)] for b in beats]
    gaps = np.diff([before[id(quiet[0])]] + [b["ts"] for b in quiet])
    assert np.median(gaps) <= 0.4 + 2 * tick + 0.1, gaps  # noticed within a tick, written at the next
    assert quiet[0]["attrs"]["open"] == [{"tid": threading.get_native_id(), "spans": ["step"]}]
    assert "span_id" not in quiet[0] and "caller" not in quiet[0]


def test_stall_threshold_without_history_is_min_times_factor_with_stacks(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0, stall_min_s=0.3, stall_factor=2)
    ot.set_step(7)
    with ot.log_trace_span("checkpoint") as span:
        stuck_until_records(1)  # until the stall is made (how soon after 0.6 s is the machine's)
    ot.shutdown()
    (stall,) = _named(_records(tmp_path), schema.INSTANT_STALL)
    attrs = stall["attrs"]
    assert attrs["span"] == "checkpoint" and attrs["threshold_s"] == 0.6 and attrs["open_s"] >= 0.6
    # On the stalled span, its thread and step, whatever thread wrote it.
    assert stall["span_id"] == f"{span.get_span_context().span_id:016x}" and stall["step"] == 7
    assert stall["tid"] == attrs["tid"] == threading.get_native_id()
    main = next(s for s in attrs["stacks"] if s["tid"] == threading.get_native_id())
    assert main["thread"] == "MainThread"
    assert main["frames"][-1].endswith(":stuck_until_records")
    assert main["frames"][-2].endswith(":test_stall_threshold_without_history_is_min_times_factor_with_stacks")
    assert not any(s["thread"] == "otel-train-watchdog" for s in attrs["stacks"])


def test_stall_threshold_with_history_is_factor_times_p99(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0, stall_min_s=0.1, stall_factor=3)
    for _ in range(6):
        with ot.log_trace_span("forward"):
            time.sleep(0.1)
    with ot.log_trace_span("forward"):
        stuck_until_records(2)  # the stall, and again at twice its open time
    ot.shutdown()
    records = _records(tmp_path)
    stalls = _named(records, schema.INSTANT_STALL)
    threshold = stalls[0]["attrs"]["threshold_s"]
    # 3 × the p99 of the six forwards before (the sketch's: within 2 % of the longest of six), whatever
    # a loaded machine made of their 0.1 s sleeps; not stall_min_s × factor = 0.3 exactly.
    longest = max(r["dur_ms"] for r in records if r["kind"] == schema.SPAN_END and r["name"] == "forward"
                  and r.get("status") == schema.STATUS_OK and r["dur_ms"] < 1000 * threshold) / 1000
    assert threshold > 0.3 and abs(threshold / (3 * longest) - 1) < 0.03, (threshold, longest)
    opens = [s["attrs"]["open_s"] for s in stalls]
    assert len(stalls) == 2 and opens[0] >= threshold and opens[1] >= 2 * threshold  # the doubling rule
    assert all(s["attrs"]["threshold_s"] == threshold for s in stalls)


def test_only_the_innermost_span_of_a_thread_is_judged(tmp_path: Path) -> None:
    # "step" learns to be short (threshold max(0.2 s, 10 x its p99) = 0.2 s); a checkpoint with no
    # history may stay open 0.2 x 10 = 2 s. The 0.5 s inside the checkpoint is 0.3 s past the step's
    # threshold, and 1.5 s short of the checkpoint's: a loaded machine once stretched a 0.3 s sleep past
    # a 0.4 s threshold here (fresh-clone run 84), so the margin on that side is wide.
    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0, stall_min_s=0.2, stall_factor=10)
    for _ in range(5):
        with ot.log_trace_span("step"):
            pass
    with ot.log_trace_span("step"), ot.log_trace_span("checkpoint"):  # ... but this one holds a checkpoint
        time.sleep(0.5)
    ot.shutdown()
    assert _named(_records(tmp_path), schema.INSTANT_STALL) == []


def test_a_parent_is_judged_once_innermost_for_stall_min_s(tmp_path: Path) -> None:
    """The moment between a long child's end and its parent's end: the parent is innermost then, open
    longer than its threshold. A look there once named a healthy step a stall (open 0.5 s against its
    0.2 s threshold) in a loaded test run. Now a span is judged only once it has also been the innermost
    for stall_min_s, since its last child ended; a thread that then stays in the parent's own code is
    a stall. The looks are made by hand, at those two moments."""
    from otel_train import runtime

    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0, stall_min_s=0.2, stall_factor=10)
    dog = runtime._active.watchdog  # type: ignore[union-attr]
    dog.stop()  # no look of its own: only the two below
    for _ in range(5):
        with ot.log_trace_span("step"):
            pass  # "step" learns to be short: its threshold is max(0.2 s, 10 x its p99) = 0.2 s
    with ot.log_trace_span("step"):
        with ot.log_trace_span("checkpoint"):  # no history: its threshold is 0.2 x 10 = 2 s
            time.sleep(0.5)
        written = runtime._active.jsonl.records_written  # type: ignore[union-attr]
        dog.check()  # the step: open 0.5 s, innermost for a moment
        assert runtime._active.jsonl.records_written == written  # type: ignore[union-attr]  # no stall
        time.sleep(0.3)  # now in the step's own code, past stall_min_s
        dog.check()
    ot.shutdown()
    (stall,) = _named(_records(tmp_path), schema.INSTANT_STALL)
    attrs = stall["attrs"]
    assert attrs["span"] == "step" and attrs["threshold_s"] == 0.2 and attrs["innermost_s"] >= 0.3
    assert attrs["open_s"] - attrs["innermost_s"] >= 0.5 - 0.002  # since the checkpoint's end


def test_a_thread_stuck_between_steps_is_a_stall_stall_min_s_after_its_last_step(tmp_path: Path) -> None:
    """A rank stuck in untraced code between two steps is inside ``train`` alone, which never closed
    (no history: threshold 0.1 s x 10 = 1 s) and has been open longer than that. It is named once it has
    been the innermost for stall_min_s (0.1 s), not only after its own 1 s threshold counted from the
    last step's end."""
    from otel_train import runtime

    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0, stall_min_s=0.1, stall_factor=10)
    dog = runtime._active.watchdog  # type: ignore[union-attr]
    dog.stop()
    with ot.log_trace_span("train"):
        with ot.log_trace_span("step"):
            time.sleep(1.0)  # train is open past its 1 s threshold now
        time.sleep(0.15)  # stuck between steps, past stall_min_s
        dog.check()
    ot.shutdown()
    (stall,) = _named(_records(tmp_path), schema.INSTANT_STALL)
    attrs = stall["attrs"]
    assert attrs["span"] == "train" and attrs["threshold_s"] == 1.0
    assert attrs["innermost_s"] >= 0.15 and attrs["open_s"] - attrs["innermost_s"] >= 1.0 - 0.002  # since the step


class FakeSink:
    """Open spans and the records the watchdog writes, without a processor."""

    def __init__(self) -> None:
        self.records_written = 0
        self.spans: list[tuple[int, str, int, int]] = []
        self.written: list[tuple[str, dict[str, Any], int | None]] = []

    def open_spans(self) -> list[tuple[int, str, int, int]]:
        return list(self.spans)

    def instant_for(self, name: str, attrs: dict[str, Any], span_id: int | None = None) -> None:
        self.records_written += 1
        self.written.append((name, attrs, span_id))


def test_a_stall_is_written_again_at_each_doubling_and_at_most_six_times() -> None:
    sink = FakeSink()
    dog = Watchdog(sink, heartbeat_s=0, stall_min_s=1.0, stall_factor=1.0)
    written = []
    for open_s in (0.5, 1.0, 1.5, 2.0, 3.9, 4.0, 8.0, 16.0, 32.0, 64.0, 1000.0):
        sink.spans = [(42, "backward", record_clock.now_ns() - int(open_s * 1e9), 1)]
        dog.check()
        written.append(len(sink.written))
    assert written == [0, 1, 1, 2, 2, 3, 4, 5, 6, 6, 6] and MAX_STALLS_PER_SPAN == 6
    assert {span_id for _, _, span_id in sink.written} == {42}
    sink.spans = [(43, "backward", record_clock.now_ns() - int(1.5e9), 1)]  # a new span: its own count
    dog.check()
    assert len(sink.written) == 7


def test_duration_sketch_quantiles_are_within_two_percent() -> None:
    rng = np.random.default_rng(0)
    values = rng.lognormal(mean=17, sigma=1.0, size=20_000)  # ns, around 25 ms
    sketch = DurationSketch()
    for v in values:
        sketch.add("forward", int(v))
    for q in (0.5, 0.9, 0.99):
        count, got = sketch.quantile("forward", q)
        want = float(np.quantile(values, q)) / 1e9
        assert count == values.size and abs(got - want) / want < 0.02, (q, got, want)
    assert sketch.quantile("never", 0.99) == (0, None)


def test_watchdog_off_means_no_thread_and_no_records(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, watchdog=False, heartbeat_s=0.1, stall_min_s=0.1, stall_factor=1)
    assert "otel-train-watchdog" not in {t.name for t in threading.enumerate()}
    with ot.log_trace_span("forward"):
        time.sleep(0.5)
    ot.shutdown()
    records = _records(tmp_path)
    assert not _named(records, schema.INSTANT_STALL) and not _named(records, schema.INSTANT_HEARTBEAT)


def test_the_thread_stops_at_shutdown_and_starts_again_with_the_next_init(tmp_path: Path) -> None:
    def watchdogs() -> int:
        return sum(t.name == "otel-train-watchdog" for t in threading.enumerate())

    ot.init(save_path=tmp_path / "a", enabled=True)
    assert watchdogs() == 1
    ot.shutdown()
    assert watchdogs() == 0
    ot.init(save_path=tmp_path / "b", enabled=True)
    assert watchdogs() == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_that_did_not_call_init_writes_nothing_and_has_no_watchdog(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0.1, stall_min_s=0.1, stall_factor=1)
    read, write = os.pipe()
    with ot.log_trace_span("data_fetch"):  # open in the parent when it forks: a stall candidate
        pid = os.fork()
        if pid == 0:  # the child: a DataLoader worker, say
            try:
                with ot.log_trace_span("forward"):
                    time.sleep(0.6)  # past every threshold and heartbeat period
                names = sorted(t.name for t in threading.enumerate())
                os.write(write, json.dumps(names).encode())
            finally:
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
    child_threads = json.loads(os.read(read, 4096))
    os.close(read)
    ot.shutdown()
    assert status == 0 and child_threads == ["MainThread"]
    records = _records(tmp_path)
    assert {r["pid"] for r in records} == {os.getpid()}
    assert _named(records, schema.INSTANT_STALL)  # the parent's watchdog saw its own open span


def test_spans_from_many_threads_while_the_watchdog_looks_cause_no_fault(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0.05, stall_min_s=0.05, stall_factor=1)
    stop = time.monotonic() + 1.0

    def work() -> None:
        while time.monotonic() < stop:
            with ot.log_trace_span("step"), ot.log_trace_span("forward"):
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ot.shutdown()
    assert not [key for key in _report.counts() if "watchdog" in key or "instant" in key]
    records = _records(tmp_path)
    starts = sum(r["kind"] == schema.SPAN_START for r in records)
    assert starts == sum(r["kind"] == schema.SPAN_END for r in records) > 1000


def test_a_write_blocked_elsewhere_holds_the_watchdog_up_for_at_most_a_second(tmp_path: Path) -> None:
    from otel_train import runtime

    ot.init(save_path=tmp_path, enabled=True, heartbeat_s=0.2, stall_min_s=60)
    jsonl = runtime._active.jsonl  # type: ignore[union-attr]
    held = threading.Event()

    def skipped() -> int:
        return sum(n for key, n in _report.counts().items() if "heartbeat" in key and "TimeoutError" in key)

    def blocked_write() -> None:  # a training thread stuck in write(2) on a hung mount, lock in hand
        with jsonl._lock:
            held.set()
            # Held until the watchdog gave up twice, however late a loaded machine runs it (a fixed 2.6 s
            # hold failed once beside a busy loop: the second try came too late to time out). A watchdog
            # that waited for the lock would never give up: the hold ends after 60 s and the test fails.
            deadline = time.monotonic() + 60.0
            while skipped() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)

    holder = threading.Thread(target=blocked_write)
    holder.start()
    held.wait()
    holder.join()
    written, deadline = jsonl.records_written, time.monotonic() + 30.0
    while jsonl.records_written == written and time.monotonic() < deadline:  # the next heartbeat, when it comes
        time.sleep(0.05)
    ot.shutdown()
    assert skipped() >= 2  # it gave up after a second, twice, while the file stayed held
    assert _named(_records(tmp_path), schema.INSTANT_HEARTBEAT)  # and wrote again once the file was free
