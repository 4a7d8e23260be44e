"""Process death and birth through the real SDK: SIGKILL, SIGTERM, atexit, fork, multiprocessing.

Every test runs the SDK in a child interpreter configured only through the environment, as a
launcher would, and reads back the files it left.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from otel_train import schema as S
from otel_train.runtime import SIGTERM_HANDLER_WAIT_S

from conftest import ReadRecords, trace_segments

TIMEOUT = 30


def spawn(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_ready(child: subprocess.Popen[str]) -> str:
    line = child.stdout.readline()
    if not line.startswith("ready"):
        child.kill()
        _, err = child.communicate(timeout=TIMEOUT)
        pytest.fail(f"child did not get ready: {line!r}\n{err}")
    return line


def _releasing(out: str) -> tuple[float, float]:
    """A child's ``releasing <ns on the records' clock> after <s>`` line, printed while it still holds a
    lock the shutdown needs: what it says is said before SIGTERM can end the process, wherever the
    process then dies (STUCK_AFTER_S, docs/runtime.md)."""
    said = out.split("\n")[0].split()
    assert said[:1] == ["releasing"] and said[2:3] == ["after"], out
    return int(said[1]) / 1e9, float(said[3])


def finish(child: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                          capture_output=True, timeout=TIMEOUT)


def by_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r[S.KIND] == kind]


def assert_gapless(records: list[dict]) -> None:
    seqs = [r[S.SEQ] for r in records]
    assert seqs == list(range(1, len(seqs) + 1))


# A step > forward nest held open until the parent acts; "ready" says both starts are on disk.
OPEN_NEST = """
import time
import otel_train as ot
{before_init}
ot.init()
with ot.training_step(7, epoch=1):
    with ot.log_trace_span("forward", micro=2):
        print("ready", flush=True)
        time.sleep(60)
"""


SDK_CHILD = """
import os, signal, threading, time
import otel_train as ot
from otel_train import runtime
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

class Null(SpanExporter):  # ot.init(handlers=[Null]): the SDK path and an export processor, no network
    def export(self, spans):
        return SpanExportResult.SUCCESS
"""


SELF_KILL_NEST = """
import os, signal
import otel_train as ot
ot.init()
with ot.training_step(7, epoch=1):
    with ot.log_trace_span("forward", micro=2):
        os.kill(os.getpid(), signal.SIGKILL)  # at once: no sleep, no flush, nothing for a writer to catch up in
"""


def test_sigkill_inside_open_spans_leaves_their_start_records(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    child = spawn(SELF_KILL_NEST, traced_env())
    finish(child)
    assert child.returncode == -signal.SIGKILL

    records = read_records(tmp_path)
    assert_gapless(records)
    assert [r[S.EVENT] for r in records] == ["process_start", "step_start", "forward_start"]
    step, forward = records[1], records[2]
    assert forward[S.PARENT_SPAN_ID] == step[S.SPAN_ID] and forward[S.TRACE_ID] == step[S.TRACE_ID]
    assert forward[S.STEP] == 7 and forward[S.EPOCH] == 1 and forward[S.ATTRS] == {"micro": 2}
    assert forward[S.PID] == child.pid


def test_sigkill_mid_stream_tears_at_most_the_last_line(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    code = """
    import otel_train as ot
    ot.init()
    for i in range(10**7):
        with ot.training_step(i):
            with ot.log_trace_span("forward"):
                ot.log_trace_scalar({"loss": 1.0 / (i + 1)})
        print(i, flush=True)  # step i's five records were made: they are on disk
    """
    # Small segments so the kill may also land around a rotation.
    child = spawn(code, traced_env(OTEL_TRAIN_MAX_FILE_SIZE_MB="0.05", OTEL_TRAIN_BACKUP_COUNT="1000"))
    seen = -1
    while seen < 300:
        seen = int(child.stdout.readline() or -1)
        assert seen >= 0 or child.poll() is None, child.stderr.read()
    child.send_signal(signal.SIGKILL)  # at once: no wait for the records
    out, _ = finish(child)
    assert child.returncode == -signal.SIGKILL
    last_step = max([seen, *(int(line) for line in out.split())])

    records = read_records(tmp_path, torn_ok=1)
    assert len(records) >= 1 + 5 * (last_step + 1)  # process_start and every step the child said it finished
    assert_gapless(records)  # nothing lost before the tail, nothing duplicated across segments
    assert by_kind(records, S.INSTANT)[-1][S.NAME] == S.INSTANT_PROCESS_START  # no process_end: it died
    # Whatever was open at the kill is an unmatched start, at most the step and its forward.
    ended = {r[S.SPAN_ID] for r in by_kind(records, S.SPAN_END)}
    open_names = [r[S.NAME] for r in by_kind(records, S.SPAN_START) if r[S.SPAN_ID] not in ended]
    assert open_names in ([], ["step"], ["step", "forward"])


def test_sigterm_ends_open_spans_incomplete_and_dies_of_sigterm(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    child = spawn(OPEN_NEST.format(before_init=""), traced_env())
    wait_ready(child)
    child.send_signal(signal.SIGTERM)
    _, err = finish(child)
    assert child.returncode == -signal.SIGTERM, err  # launchers see the same exit status as without us

    records = read_records(tmp_path)
    assert_gapless(records)
    assert [r[S.EVENT] for r in records] == [
        "process_start", "step_start", "forward_start", "forward_end", "step_end", "process_end"]
    forward_end, step_end, end = records[3:]
    assert forward_end[S.STATUS] == step_end[S.STATUS] == S.STATUS_INCOMPLETE  # innermost first
    assert forward_end[S.SPAN_ID] == records[2][S.SPAN_ID] and step_end[S.SPAN_ID] == records[1][S.SPAN_ID]
    assert step_end[S.DUR_MS] >= forward_end[S.DUR_MS] > 0
    assert end[S.ATTRS]["incomplete_spans"] == 2 and end[S.ATTRS]["records"] == end[S.SEQ]
    assert "Traceback" not in err


def test_sigterm_inside_an_export_processor_waits_until_it_is_out(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """A SIGTERM that lands while the main thread queues a span for an exporter (inside the batch
    processor's lock) is handled once it is out. Shutting down there ended the open spans through that
    processor again, from inside it: with its lock not reentrant, the process hung in shutdown (a kill
    trial of the fault suite, caught with py-spy). The lock is held here by hand, as ``on_end`` holds it.

    The child says, on the records' clock, when it lets go of the lock; ``process_end`` must come after.
    How far the main thread gets once out is not asked: SIGTERM acts there at the next bytecode, or, on a
    machine that keeps the main thread off its CPU for STUCK_AFTER_S, from the stuck-main watch, which
    may end the process half-way through a ``print`` (CI: the child's stdout was "out" without its newline).
    """
    code = SDK_CHILD + textwrap.dedent("""
    from otel_train import record_clock
    ot.init(handlers=[Null])
    (batch,) = runtime._active.batch_processors
    with ot.training_step(1):
        with ot.log_trace_span("forward"):
            with batch._lock:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs in here, and must leave shutdown for later
                print("releasing", record_clock.now_ns(), "after", 0, flush=True)
            time.sleep(30)
    """)
    child = spawn(code, traced_env())
    out, err = finish(child)
    assert child.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err
    released_s, _ = _releasing(out)
    records = read_records(tmp_path)
    assert records[-1][S.EVENT] == "process_end" and records[-1][S.TS] >= released_s, (records[-1], released_s)
    assert_gapless(records)
    assert [r[S.EVENT] for r in records] == [
        "process_start", "step_start", "forward_start", "forward_end", "step_end", "process_end"]
    assert records[3][S.STATUS] == records[4][S.STATUS] == S.STATUS_INCOMPLETE


@pytest.mark.parametrize("held", ["span._attributes._lock", "batch._wake._cond"])
def test_sigterm_while_the_main_thread_holds_a_lock_shutdown_needs_does_not_hang(
        held: str, tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """A SIGTERM that lands while the main thread holds a lock no check of ours knows of, and the
    shutdown needs: an SDK span's attribute lock (taken in ``set_attribute``, by the step-context
    processor at every span start) or an export processor's wake ``Event`` (taken in ``set``, when a span
    fills a batch). The
    handler used to shut down right there, on that thread, and waited for the lock for ever (the kill
    trials under load: about 2 in 1,000). The shutdown thread waits for it instead; the handler, having
    waited ``SIGTERM_HANDLER_WAIT_S``, lets the main thread go on and let go of it, and the process then
    dies of SIGTERM with its file whole. The lock is held here by hand, as those calls hold it."""
    code = SDK_CHILD + textwrap.dedent(f"""
    from otel_train import record_clock
    ot.init(handlers=[Null])
    (batch,) = runtime._active.batch_processors
    batch.max_export_batch_size = 1  # every span queued wakes the export thread (Event.set)
    with ot.training_step(1):
        with ot.log_trace_span("forward") as span:
            with {held}:
                start = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs in here, and waits for the shutdown thread in vain
                print("releasing", record_clock.now_ns(), "after", time.monotonic() - start, flush=True)
            time.sleep(30)
    """)
    child = spawn(code, traced_env())
    started = time.monotonic()
    out, err = finish(child)
    took = time.monotonic() - started
    assert child.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err
    assert took < 20, took  # the handler's wait (5 s) and a shutdown, not the child's 30 s sleep
    released_s, held_s = _releasing(out)
    assert held_s >= SIGTERM_HANDLER_WAIT_S, out  # the handler waited for the shutdown thread, in vain
    records = read_records(tmp_path)
    assert records[-1][S.EVENT] == "process_end" and records[-1][S.TS] >= released_s, (records[-1], released_s)
    assert_gapless(records)
    events = [r[S.EVENT] for r in records]
    # The shutdown's deadline (3 s) passed while it waited: the exporter may get nothing, counted.
    dropped = [r[S.ATTRS]["count"] for r in records if r[S.EVENT] == S.INSTANT_SPANS_DROPPED]
    assert events == ["process_start", "step_start", "forward_start", "forward_end", "step_end",
                      *[S.INSTANT_SPANS_DROPPED] * len(dropped), "process_end"]
    assert records[3][S.STATUS] == records[4][S.STATUS] == S.STATUS_INCOMPLETE
    end = records[-1][S.ATTRS]
    assert end["signal"] == "SIGTERM" and end["spans_dropped"] == sum(dropped) <= 2


def test_a_previous_handler_that_returns_runs_once_after_a_shutdown_that_waited(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """The handler gave up waiting (a lock held, as above), so the shutdown thread sends SIGTERM again once
    it is done: the handler that was there before ``init`` then runs, once, and a process it does not end
    (Lightning's sets a flag) goes on, its trace ended."""
    code = SDK_CHILD + textwrap.dedent("""
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    ot.init(handlers=[Null])
    with ot.training_step(1):
        with ot.log_trace_span("forward") as span:
            with span._attributes._lock:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                print("holding", calls, flush=True)  # the shutdown waits for this lock: no previous yet
            end = time.monotonic() + 20
            while not calls and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(0.5)  # a second call would come within this
            print("previous handler", calls, "tracing", ot.is_enabled(), flush=True)
    """)
    child = spawn(code, traced_env())
    out, err = finish(child)
    assert child.returncode == 0, err
    assert out == f"holding []\nprevious handler [{int(signal.SIGTERM)}] tracing False\n", err
    records = read_records(tmp_path)
    assert_gapless(records)
    assert records[-1][S.EVENT] == "process_end" and records[-1][S.ATTRS]["signal"] == "SIGTERM"
    assert [r[S.STATUS] for r in records if r[S.EVENT] in ("forward_end", "step_end")] == [S.STATUS_INCOMPLETE] * 2


def test_a_second_sigterm_while_the_handler_waits_does_not_lengthen_its_wait(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """A second SIGTERM ends the waiting handler's ``select`` and runs the handler inside itself (PEP 475):
    that call waits only as long as the one it interrupted. Waiting its own 5 s, it kept the main thread
    (and the lock it held) 3 s longer here: every further signal, 5 s more."""
    code = SDK_CHILD + textwrap.dedent("""
    ot.init(handlers=[Null])
    main = threading.main_thread().ident

    def second():
        time.sleep(3.0)
        signal.pthread_kill(main, signal.SIGTERM)

    with ot.training_step(1):
        with ot.log_trace_span("forward") as span:
            with span._attributes._lock:
                start = time.monotonic()
                threading.Thread(target=second, daemon=True).start()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                print(f"held {time.monotonic() - start:.2f}", flush=True)  # before the shutdown can end us
            time.sleep(30)
    """)
    child = spawn(code, traced_env())
    out, err = finish(child)
    assert child.returncode == -signal.SIGTERM, err
    held = float(out.split()[1])
    assert SIGTERM_HANDLER_WAIT_S <= held < SIGTERM_HANDLER_WAIT_S + 3.0, out  # the second's own wait: >= 8 s
    records = read_records(tmp_path)
    assert_gapless(records)
    assert records[-1][S.EVENT] == "process_end" and records[-1][S.ATTRS]["signal"] == "SIGTERM"


def test_sigterm_chains_a_handler_installed_before_init(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    handler = """
import signal, sys
def on_term(signum, frame):
    print("user handler", signum, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, on_term)
"""
    child = spawn(OPEN_NEST.format(before_init=handler), traced_env())
    wait_ready(child)
    child.send_signal(signal.SIGTERM)
    out, err = finish(child)
    assert out == f"user handler {int(signal.SIGTERM)}\n", err
    assert child.returncode == 3  # the user's handler decided how to leave

    records = read_records(tmp_path)
    assert_gapless(records)
    # SystemExit unwinds the with-blocks and runs atexit: shutdown already ran once, nothing doubles.
    assert [r[S.EVENT] for r in records][3:] == ["forward_end", "step_end", "process_end"]
    assert {r[S.STATUS] for r in by_kind(records, S.SPAN_END)} == {S.STATUS_INCOMPLETE}


# Two gloo processes: rank 0 (traced) waits in its second all-reduce, inside a C call, until rank 1 (not
# traced) finds the file "go" in the directory both are given.
STUCK_IN_C = """
import datetime, os, signal, sys, time
import torch
import torch.distributed as dist
rank, where = int(sys.argv[1]), sys.argv[2]
ran = []
if rank == 0:
    def previous(signum, frame):  # sets a flag, as Lightning's does
        with open(os.path.join(where, "previous"), "a") as f:
            f.write("ran\\n")
        ran.append(signum)
    signal.signal(signal.SIGTERM, previous)
    import otel_train as ot
    ot.init()
store = dist.FileStore(os.path.join(where, "store"), 2)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    while not os.path.exists(os.path.join(where, "go")):
        time.sleep(0.05)
else:
    print("ready", flush=True)
dist.all_reduce(t)
dist.destroy_process_group()  # without it gloo's threads may abort the exit (docs/comm.md, "Exit")
sys.exit(3 if ran else 0)
"""


def test_sigterm_while_the_main_thread_is_stuck_in_a_collective_ends_the_trace_at_once(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """Rank 0's main thread waits inside gloo's all-reduce (C++) for a peer that does not come: CPython
    cannot run a Python handler there, so before the stuck-main watch a SIGTERM did nothing until the
    collective returned, and a launcher's SIGKILL 30 s later left the file without ``process_end``. Now the
    watch ends the trace while the main thread is still stuck; the handler that was there before ``init``
    runs once, when the collective returns (here: when the peer comes), and the process goes on."""
    pytest.importorskip("torch.distributed")
    save, where = tmp_path / "run", tmp_path / "job"
    where.mkdir()
    ranks = [subprocess.Popen([sys.executable, "-c", STUCK_IN_C, str(rank), str(where)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=traced_env(save, OMP_NUM_THREADS="1")) for rank in (0, 1)]
    try:
        wait_ready(ranks[0])
        time.sleep(0.2)  # into the all-reduce: nothing below depends on how far in
        ranks[0].send_signal(signal.SIGTERM)
        end = time.monotonic() + TIMEOUT
        while not [r for r in read_records(save, torn_ok=1) if r[S.EVENT] == "process_end"]:
            assert ranks[0].poll() is None, ranks[0].communicate()
            assert time.monotonic() < end, "no process_end while the main thread waits in the collective"
            time.sleep(0.05)
        assert not (where / "previous").exists()  # the main thread is still in the collective
        (where / "go").touch()
        out, err = finish(ranks[0])
        assert ranks[0].returncode == 3, err  # the previous handler ran, once the collective returned
        finish(ranks[1])
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert (where / "previous").read_text() == "ran\n"
    records = read_records(save)
    assert_gapless(records)
    assert [r[S.EVENT] for r in records].count("process_end") == 1
    assert records[-1][S.EVENT] == "process_end" and records[-1][S.ATTRS]["signal"] == "SIGTERM"
    stuck = [r for r in records if r[S.EVENT] == "comm.all_reduce_end"][-1]
    assert stuck[S.STATUS] == S.STATUS_INCOMPLETE  # the collective it was in, ended by the shutdown


def test_a_sigterm_the_handler_took_is_not_taken_again_by_the_stuck_main_watch(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """The watch judges the main thread stuck by the signal's stacks still unread in its pipe; the
    handler empties the pipe when it runs. A handler that returns (Lightning's sets a flag) leaves the
    process running Python well past ``STUCK_AFTER_S``: its signal must not be taken a second time (a
    second shutdown round, and the previous handler run again by its resend)."""
    code = SDK_CHILD + textwrap.dedent("""
    from otel_train import sigterm
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    ot.init(handlers=[Null])
    with ot.training_step(1):
        os.kill(os.getpid(), signal.SIGTERM)
        end = time.monotonic() + 4 * sigterm.STUCK_AFTER_S + 1.0
        while time.monotonic() < end:
            time.sleep(0.01)
    handler = runtime._sigterm_handler
    print("previous", calls, "rounds", handler.thread.rounds_done, "taken", handler.watch.taken, flush=True)
    """)
    child = spawn(code, traced_env())
    out, err = finish(child)
    assert child.returncode == 0, err
    assert out == f"previous [{int(signal.SIGTERM)}] rounds 1 taken 0\n", err
    records = read_records(tmp_path)
    assert [r[S.EVENT] for r in records].count("process_end") == 1


def test_normal_exit_without_shutdown_runs_it_at_exit(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    code = """
    import threading
    import otel_train as ot
    ot.init()
    ot.set_step(4)
    ot.log_trace_span("eval").__enter__()  # left open by the main thread
    entered = threading.Event()
    def loader():
        with ot.log_trace_span("data_fetch"):
            entered.set()
            threading.Event().wait()  # a daemon thread that never finishes its span
    threading.Thread(target=loader, daemon=True).start()
    entered.wait(10)
    """
    proc = run(code, traced_env())
    assert proc.returncode == 0, proc.stderr

    records = read_records(tmp_path)
    assert_gapless(records)
    ends = by_kind(records, S.SPAN_END)
    assert sorted(r[S.NAME] for r in ends) == ["data_fetch", "eval"]
    assert all(r[S.STATUS] == S.STATUS_INCOMPLETE and r[S.STEP] == 4 for r in ends)
    assert records[-1][S.EVENT] == S.INSTANT_PROCESS_END and by_kind(records, S.INSTANT).count(records[-1]) == 1
    assert records[-1][S.ATTRS]["incomplete_spans"] == 2


def test_forked_children_never_write_into_the_parent_file(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    """What a forked child does (``os.fork``, a ``fork``-context multiprocessing worker, a DataLoader worker):

    it inherits the parent's open file descriptor but traces nothing — every API call is a no-op in the
    child, so the parent's file never gets a record from another pid and nothing the parent wrote before
    the fork is written twice. A child that wants its own trace calls ``ot.init()``; that opens a file of
    its own (its pid in the records, a fresh random part in the name). A multiprocessing worker that does
    so is shut down cleanly when it leaves; a bare ``os.fork`` child that leaves through ``os._exit``
    skips every exit hook, so it calls ``ot.shutdown()`` itself.
    """
    code = """
    import multiprocessing, os, sys
    import otel_train as ot

    def traced_work(i):
        with ot.log_trace_span("worker_task", i=i):
            ot.log_trace_instant("worker_instant")
            ot.log_trace_scalar({"x": i})
        return os.getpid(), ot.is_enabled()

    ot.init()
    with ot.training_step(1):
        with ot.log_trace_span("forward"):
            pid = os.fork()
            if pid == 0:  # a bare fork child, inside the parent's open spans
                traced_work(0)
                os._exit(0 if not ot.is_enabled() else 1)
            assert os.waitpid(pid, 0)[1] == 0
            for _ in range(8):  # leaving `with Pool` SIGTERMs workers, some right after their fork
                with multiprocessing.get_context("fork").Pool(2) as pool:
                    results = pool.map(traced_work, range(4))
                assert all(not enabled for _, enabled in results), results

            pid = os.fork()
            if pid == 0:  # a child that traces on its own
                ot.init(source="child")
                with ot.training_step(100):
                    traced_work(1)
                ot.shutdown()
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            print(pid, flush=True)
    ot.shutdown()
    """
    proc = run(code, traced_env())
    assert proc.returncode == 0, proc.stderr
    child_pid = int(proc.stdout)

    records = read_records(tmp_path)
    pids = {r[S.PID] for r in records}
    assert len(pids) == 2 and child_pid in pids
    parent = [r for r in records if r[S.SOURCE] == "training"]
    child = [r for r in records if r[S.SOURCE] == "child"]
    assert {r[S.PID] for r in child} == {child_pid} and child_pid not in {r[S.PID] for r in parent}
    assert_gapless(parent)  # not one duplicated or foreign record
    assert [r[S.EVENT] for r in parent] == [
        "process_start", "step_start", "forward_start", "forward_end", "step_end", "process_end"]
    assert_gapless(child)
    assert [r[S.EVENT] for r in child] == [
        "process_start", "step_start", "worker_task_start", "worker_instant", "scalar", "worker_task_end",
        "step_end", "process_end"]
    assert child[1][S.STEP] == 100 and child[1][S.RELATIVE_STEP] == 0

    names = sorted(p.name for segments in trace_segments(tmp_path) for p in segments)
    assert len(names) == 2 and names[0].startswith("child.global_rank_0.")
    assert names[1].startswith("training.global_rank_0.")


def test_multiprocessing_worker_that_inits_ends_cleanly_without_shutdown(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    code = """
    import multiprocessing
    import otel_train as ot

    def work():
        ot.init(source="worker")
        ot.training_step(3).__enter__()  # both still open when the worker returns
        ot.log_trace_span("forward").__enter__()

    if __name__ == "__main__":
        worker = multiprocessing.get_context("fork").Process(target=work)
        worker.start()
        worker.join(20)
        assert worker.exitcode == 0, worker.exitcode
    """
    proc = run(code, traced_env())
    assert proc.returncode == 0, proc.stderr
    records = read_records(tmp_path)
    assert_gapless(records)
    # multiprocessing leaves through os._exit (no atexit): without its finalizer this looked like a crash.
    assert [r[S.EVENT] for r in records] == [
        "process_start", "step_start", "forward_start", "forward_end", "step_end", "process_end"]
    assert records[3][S.STATUS] == records[4][S.STATUS] == S.STATUS_INCOMPLETE


def _blocked(mask_hex: str, sig: int) -> bool:
    return bool(int(mask_hex, 16) >> (sig - 1) & 1)


def test_the_runtimes_threads_never_take_the_processs_signals(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]]) -> None:
    # The kernel hands a signal sent to the process to any thread that does not block it; Python runs the
    # handler only in the main thread, so one of our threads taking it left a main thread blocked in a
    # lock unwoken (otel_train/_threads.py). Each of ours blocks SIGTERM and SIGINT; the main thread none.
    code = """
    import threading
    import otel_train as ot
    ot.init()
    for t in threading.enumerate():
        with open(f"/proc/self/task/{t.native_id}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigBlk:"))
        print(t.name, mask)
    ot.shutdown()
    """
    proc = run(code, traced_env(OTEL_TRAIN_WATCHDOG="true"))
    assert proc.returncode == 0, proc.stderr
    masks = dict(line.split() for line in proc.stdout.splitlines())
    ours = {name: mask for name, mask in masks.items() if name.startswith(("otel_train", "otel-train"))}
    expected = {"otel_train.file_check", "otel-train-watchdog", "otel_train.sigterm", "otel_train.sigterm-watch"}
    assert expected <= set(ours), masks
    assert all(_blocked(m, signal.SIGTERM) and _blocked(m, signal.SIGINT) for m in ours.values()), ours
    assert not _blocked(masks["MainThread"], signal.SIGTERM), masks


def test_a_multiprocessing_worker_that_inits_dies_of_sigterm_at_once(
        tmp_path: Path, traced_env: Callable[..., dict[str, str]], read_records: ReadRecords) -> None:
    # Pool.terminate and DataLoader shutdown SIGTERM workers that may be anywhere: a worker keeps the default
    # action (docs/runtime.md), so it dies of it even idle in a semaphore, its records whole up to the kill.
    code = """
    import glob, multiprocessing, os, signal, time
    import otel_train as ot

    def work(ready, gate):
        ot.init(source="worker")
        with ot.log_trace_span("forward"):
            pass
        ready.set()
        gate.acquire()  # idle in a semaphore, as a pool worker waits for its next task

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("fork")
        ready, gate = ctx.Event(), ctx.Semaphore(0)
        worker = ctx.Process(target=work, args=(ready, gate))
        worker.start()
        assert ready.wait(60)
        # The worker's writer thread has written what was queued: its three records are on disk.
        files = os.path.join(os.environ["OTEL_TRAIN_SAVE_PATH"], "structured_logs", "*")
        deadline = time.monotonic() + 60
        while sum(open(f, "rb").read().count(b"\\n") for f in glob.glob(files)) < 3:
            assert time.monotonic() < deadline, "the worker's records never reached its trace file"
            time.sleep(0.01)
        worker.terminate()
        worker.join(10)
        print(worker.exitcode)
    """
    proc = run(code, traced_env())
    assert proc.returncode == 0 and proc.stdout.split() == [str(-signal.SIGTERM)], (proc.stdout, proc.stderr)
    records = read_records(tmp_path)
    assert_gapless(records)
    assert [r[S.EVENT] for r in records] == ["process_start", "forward_start", "forward_end"]
