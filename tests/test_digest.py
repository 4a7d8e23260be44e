"""Per-process digests: written by the watchdog's thread and at shutdown, replaced atomically; what
``summarize --fast`` takes from them (spans open since long before the tail, approximate phases)."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from analysis_fixtures import Proc, write_run

from otel_train import schema, sketch
from otel_train.analysis import fast, records
from otel_train.analysis.fast import summarize_fast
from otel_train.analysis.records import Digest, find_process_files
from otel_train.analysis.summary import summarize
from otel_train.phases import DATA_FETCH

US_MS = 0.001
"""A microsecond in ms: records keep durations cut to whole µs."""

HUNG_CHILD = r"""
import os, random, sys, time
import otel_train as ot
ot.init(save_path=sys.argv[1], enabled=True, run_id="digest-test", digest_s=0.2, heartbeat_s=0.5)
rng = random.Random(7)
with ot.log_trace_span("train"):            # a root span open since the first records
    for step in range(300):
        with ot.training_step(step):
            for name, ms in (("data_fetch", 2.0), ("forward", 3.0)):  # ms: far above the file's 1 µs
                with ot.log_trace_span(name, note="x" * 40):
                    t = time.perf_counter() + ms / 1000 * rng.uniform(0.5, 2.0)
                    while time.perf_counter() < t:
                        pass
    with ot.training_step(300):
        with ot.log_trace_span("forward"):
            print("hung", flush=True)
            time.sleep(600)
"""


def _kill_when_hung(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HUNG_CHILD, str(run)], stdout=subprocess.PIPE, text=True,
                             env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    try:
        assert child.stdout.readline().strip() == "hung"  # type: ignore[union-attr]
        # A digest taken while it hangs (every 0.2 s while heartbeats grow the file): step 300's forward
        # among its open spans.
        _wait_for(lambda: _digest_taken_in_the_hang(run), child, "no digest taken while it hangs")
    finally:
        child.kill()
        child.wait()
    return run


def _wait_for(done: Callable[[], bool], child: subprocess.Popen, failure: str, cap_s: float = 60.0) -> None:
    """Poll ``done`` until true while ``child`` lives: waited for, not slept for (a loaded machine may
    take its time); past ``cap_s``, or the child dead, the test fails with ``failure``."""
    deadline = time.monotonic() + cap_s
    while not done():
        assert time.monotonic() < deadline and child.poll() is None, failure
        time.sleep(0.05)


def _digests(run: Path) -> list[Path]:
    return list((run / schema.DIGESTS_DIR).glob("*" + schema.DIGEST_SUFFIX))


def _digest_taken_in_the_hang(run: Path) -> bool:
    for path in _digests(run):
        try:
            digest = msgspec.json.decode(path.read_bytes(), type=Digest)
        except (OSError, msgspec.DecodeError):
            continue
        if any(span.name == "forward" and span.step == 300 for span in digest.open):
            return True
    return False


def test_fast_sees_a_root_span_open_since_the_start_and_approximate_phases(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _kill_when_hung(tmp_path)
    full = summarize(run, warn=pytest.fail)
    windows = []

    def read_tail(pf, nbytes, bad):  # the real reader; this only notes how far back --fast looked
        windows.append(nbytes)
        return records.read_tail(pf, nbytes, bad)

    monkeypatch.setattr(fast, "read_tail", read_tail)
    quick = summarize_fast(run, warn=pytest.fail)
    (trace,) = (run / schema.STRUCTURED_LOGS_DIR).glob("*.jsonl")
    assert windows == [fast.FIRST_WINDOW] < [trace.stat().st_size]  # the root span came from the digest
    assert quick["digests"] == 1
    assert quick["unclosed"] == full["unclosed"]
    assert [u["name"] for u in quick["unclosed"]] == ["train", "step", "forward"]
    assert quick["processes"] == [{**row, "records": None} for row in full["processes"]]
    exact = {row["name"]: row for row in full["phases"]}
    assert {row["name"] for row in quick["phases"]} == {"step", "data_fetch", "forward"}
    durations: dict[str, list[float]] = {}
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == schema.SPAN_END and rec["status"] == schema.STATUS_OK:
            durations.setdefault(rec["name"], []).append(rec["dur_ms"])
    for row in quick["phases"]:
        assert row["approx"] is True and row["count"] == exact[row["name"]]["count"]
        ordered = sorted(durations[row["name"]])
        for key, q in (("p50_ms", 0.5), ("p95_ms", 0.95)):
            # The sketch's bound: within RELATIVE_ACCURACY of the order statistic at rank ⌈q·n⌉, as the
            # sketch counted it (ns); the file's dur_ms is that duration cut to whole µs, up to 1 µs less
            # (5.865 ms written for 5.8659 ms: a duration past bucket 786's edge, read back as 5.924 ms).
            written = ordered[math.ceil(q * len(ordered)) - 1]
            bound = sketch.RELATIVE_ACCURACY * (written + US_MS) + US_MS
            assert abs(row[key] - written) <= bound, (key, row[key], written, bound)
        assert row["max_ms"] == pytest.approx(exact[row["name"]]["max_ms"], rel=1e-3)


def test_without_the_digest_the_old_root_span_is_out_of_view(tmp_path: Path) -> None:
    run = _kill_when_hung(tmp_path)
    for path in _digests(run):
        path.unlink()
    quick = summarize_fast(run, warn=pytest.fail)
    assert quick["phases"] is None and quick["digests"] == 0
    assert [u["name"] for u in quick["unclosed"]] == ["step", "forward"]  # why the digest keeps open spans


CHURN_CHILD = r"""
import sys
import otel_train as ot
ot.init(save_path=sys.argv[1], enabled=True, digest_s=0.001, heartbeat_s=0.2)  # a look every 50 ms
step = 0
while True:
    step += 1
    with ot.training_step(step):
        for i in range(40):
            with ot.log_trace_span(f"phase_{i}"):
                pass
"""


def test_a_kill_during_a_digest_write_leaves_the_previous_digest_whole(tmp_path: Path) -> None:
    decoder = msgspec.json.Decoder(Digest)
    rng = random.Random(11)
    seen = 0
    for trial in range(12):
        run = tmp_path / f"run{trial}"
        child = subprocess.Popen([sys.executable, "-c", CHURN_CHILD, str(run)],
                                 env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
        # Import and init (seconds on a loaded machine), then a digest at each look (every 50 ms): the
        # first one waited for, then a kill at a random moment of the churn.
        _wait_for(lambda: bool(_digests(run)), child, "no digest written")
        time.sleep(rng.random())
        if trial == 0:
            # Each digest is a new file renamed over the old one, never rewritten in place: a reader
            # holding the old one open keeps reading it whole while the name moves on.
            (held,) = _digests(run)
            with held.open("rb") as f:
                before = f.read()
                time.sleep(2.5)
                f.seek(0)
                assert f.read() == before
            assert decoder.decode(held.read_bytes()).seq > decoder.decode(before).seq
        child.send_signal(signal.SIGKILL)
        child.wait()
        (pf,) = find_process_files(run)
        digest = Path(schema.digest_file_name(str(pf.paths[-1])))
        if digest.exists():
            seen += 1
            decoded = decoder.decode(digest.read_bytes())  # whole: never a torn or half-renamed file
            assert decoded.seq > 0 and decoded.phases
    assert seen == 12  # a digest existed before each kill: one is there after it, whole


@pytest.mark.parametrize("tid", [1, 2], ids=["outnested-on-its-thread", "found-in-the-bytes-since"])
def test_a_span_open_at_the_digest_that_ended_before_the_tail_is_not_unclosed(tmp_path: Path, tid: int) -> None:
    # On its own thread (tid 1) a later span under ``train`` shows step 10 ended; told it ran on another
    # thread (tid 2), the reader must find step 10's end record in the bytes written since the digest.
    proc = Proc(rank=0, world_size=1)
    train = proc.start("train")
    proc.steps(range(10))
    proc.set_step(10)
    step10 = proc.start("step")
    taken = len(proc.lines)  # the digest: taken here, with train and step 10 open
    proc.advance(2)
    proc.end()
    proc.steps(range(11, 400))  # far more than the first tail window
    proc.stop_inside(400, [DATA_FETCH])
    logs = write_run(tmp_path, [proc])
    (trace,) = logs.glob("*.jsonl")
    starts = {r["span_id"]: r for r in map(json.loads, proc.lines[:taken]) if r["kind"] == "span_start"}
    digest = {"v": 1, "ts": starts[step10]["ts"], "seq": taken,
              "file": {"ino": trace.stat().st_ino, "size": sum(len(line) + 1 for line in proc.lines[:taken])},
              "open": [{"span_id": sid, "name": starts[sid]["name"], "parent_span_id": starts[sid].get("parent_span_id"),
                        "trace_id": starts[sid]["trace_id"], "step": starts[sid].get("step"),
                        "start_ts": starts[sid]["ts"], "tid": 1 if sid == train else tid} for sid in (train, step10)],
              "gamma": 1.02, "phases": {}}
    Path(schema.digest_file_name(str(trace))).parent.mkdir()
    Path(schema.digest_file_name(str(trace))).write_text(json.dumps(digest))
    full = summarize(tmp_path, warn=pytest.fail)
    quick = summarize_fast(tmp_path, warn=pytest.fail)
    assert quick["unclosed"] == full["unclosed"]
    assert [(u["name"], u["step"]) for u in quick["unclosed"]] == [("train", None), ("step", 400), (DATA_FETCH, 400)]


def test_the_shutdown_digest_leaves_out_spans_ended_as_incomplete(tmp_path: Path) -> None:
    code = ("import sys, otel_train as ot\n"
            "ot.init(save_path=sys.argv[1], enabled=True, run_id='digest-shutdown')\n"
            "for _ in range(3):\n    with ot.log_trace_span('forward'):\n        pass\n"
            "ot.log_trace_span('checkpoint').__enter__()  # still open at shutdown: ended as incomplete\n"
            "ot.shutdown()\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60,
                   env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    full, quick = summarize(tmp_path, warn=pytest.fail), summarize_fast(tmp_path, warn=pytest.fail)
    assert quick["digests"] == 1
    assert [(r["name"], r["count"]) for r in quick["phases"]] == [(r["name"], r["count"]) for r in full["phases"]] == [
        ("forward", 3)]


SLOW_AT_THE_END = r"""
import os, sys, time
import otel_train as ot
from otel_train.exporters.jsonl import writer as writer_module

real_write, slow = os.write, []

def write(fd, data):
    if slow and slow.pop():
        time.sleep(0.5)  # one write that takes half a second (an NFS hiccup) just as the job ends
    return real_write(fd, data)

writer_module.os.write = write
ot.init(save_path=sys.argv[1], enabled=True, run_id="digest-slow", digest_s=3600)
for _ in range(200):
    with ot.log_trace_span("forward"):
        pass
slow.append(True)
with ot.log_trace_span("forward"):  # queued: the writer thread takes it in its turn, slowly
    pass
ot.shutdown()
"""


def test_the_shutdown_digest_waits_for_a_slow_writer(tmp_path: Path) -> None:
    # CI: under load the writer had a backlog at shutdown longer than the hot path's 0.1 s wait, and the
    # run ended with no digest at all. Shutdown waits for the writer as close does.
    proc = subprocess.run([sys.executable, "-c", SLOW_AT_THE_END, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    assert proc.returncode == 0, proc.stderr
    (digest,) = (tmp_path / schema.DIGESTS_DIR).glob(f"*{schema.DIGEST_SUFFIX}")
    body = json.loads(digest.read_text())
    assert body["phases"]["forward"]["count"] == 201, body["phases"]
    quick = summarize_fast(tmp_path, warn=pytest.fail)
    assert quick["digests"] == 1 and [(r["name"], r["count"]) for r in quick["phases"]] == [("forward", 201)]
