"""The runtime's one thread primitive (otel_train/_threads.py ``Worker``): start once, quiet signals,
stop within a deadline then drain, restart after ``done``, nothing held in a fork child."""

from __future__ import annotations

import signal
import threading
import time

from otel_train._threads import QUIET, Worker


def test_start_once_stop_then_drain() -> None:
    looks: list[int] = []
    drained: list[float] = []
    worker: Worker

    def loop() -> None:
        while not worker.sleep(0.01):
            looks.append(1)

    worker = Worker("otel-train-test", loop, drain=drained.append)
    assert worker.start() and not worker.start()  # one thread at a time
    assert worker.thread is not None and worker.thread.daemon and worker.thread.name == "otel-train-test"
    time.sleep(0.05)
    assert worker.stop(1.0) and drained == [1.0] and looks


def test_stop_returns_by_its_deadline_when_the_loop_does_not_end() -> None:
    release = threading.Event()
    worker = Worker("otel-train-test-stuck", lambda: release.wait(10))
    worker.start()
    start = time.monotonic()
    assert worker.stop(0.1) is False
    assert time.monotonic() - start < 1.0
    release.set()
    assert worker.join(2.0)


def test_a_loop_that_ends_by_itself_can_be_started_again() -> None:
    runs: list[int] = []
    worker: Worker

    def loop() -> None:
        runs.append(1)
        worker.done()

    worker = Worker("otel-train-test-once", loop)
    worker.start()
    deadline = time.monotonic() + 2
    while worker.thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.start()
    worker.join(2.0)
    assert runs == [1, 1]


def test_quiet_workers_block_sigterm_and_sigint_others_keep_the_starters_mask() -> None:
    masks: dict[str, set[int]] = {}

    def record(key: str) -> None:
        masks[key] = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    Worker("quiet", lambda: record("quiet")).start()
    Worker("loud", lambda: record("loud"), quiet=False).start()
    deadline = time.monotonic() + 2
    while len(masks) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(QUIET) <= masks["quiet"]
    assert not set(QUIET) & masks["loud"] - set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def test_pause_sees_a_stop_within_a_slice() -> None:
    worker = Worker("otel-train-test-pause", lambda: None)
    threading.Timer(0.05, worker.stopping.set).start()
    start = time.monotonic()
    assert worker.pause(5.0, 0.02) is True
    assert time.monotonic() - start < 1.0
    assert worker.pause(0.01, 0.02) is True  # already asked to stop


def test_forget_holds_no_thread_and_a_fresh_stop_flag() -> None:
    worker = Worker("otel-train-test-fork", lambda: None)
    worker.start()
    worker.stopping.set()
    worker.forget()
    assert worker.thread is None and not worker.stopping.is_set()
