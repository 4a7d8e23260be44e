"""Forks inside a traced process: DataLoader workers and multiprocessing.Pool, with and without init
in the child. The parent's file holds only the parent's records; a child that calls init gets a
file of its own that ends cleanly; nothing hangs."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
from faultlib import assert_clean_end, reported, segments, traces, trials

import otel_train as ot
from otel_train import schema as S

torch = pytest.importorskip("torch")


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> object:
        with ot.log_trace_span("load", i=i):  # traced only in a worker that called init
            return torch.full((4,), float(i))


def _init_child(save_path: str) -> None:
    ot.init(save_path=save_path, enabled=True, source="child", watchdog=False)


def _worker_init(worker_id: int) -> None:
    _init_child(os.environ["FAULT_CHILD_RUN"])


def _work(i: int) -> int:
    with ot.log_trace_span("pool_task", i=i):
        ot.log_trace_instant("in_child", i=i)
    return i * i


def _parent_records_ok(run: Path) -> dict:
    (trace,) = [t for name, t in zip(segments(run), traces(run)) if name.startswith("training.")]
    assert_clean_end(trace)
    assert {r[S.PID] for r in trace.records} == {os.getpid()}
    return trace.records[-1]


@pytest.mark.parametrize("init_in_child", [False, True])
def test_dataloader_workers_and_pools(tmp_path: Path, init_in_child: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    holds = ("the parent's file: only the parent's pid, seq gapless, every span ended; with init in the "
             "child each child that leaves normally ends its own file cleanly (process_end), a terminated one "
             "holds whole records in order up to the kill; no hang")
    label = "with init in the child" if init_in_child else "child never calls init"
    pools = trials(10)
    with reported(f"forks: DataLoader workers (fork) and {pools + 1} multiprocessing.Pools, {label}", holds, pools + 1):
        run = tmp_path / "run"
        monkeypatch.setenv("FAULT_CHILD_RUN", str(run))
        ot.init(save_path=run, enabled=True)
        fork = multiprocessing.get_context("fork")
        loader = torch.utils.data.DataLoader(
            Squares(), batch_size=4, num_workers=2, multiprocessing_context=fork,
            worker_init_fn=_worker_init if init_in_child else None, timeout=60)
        for step, batch in enumerate(loader):
            with ot.training_step(step), ot.log_trace_span("forward"):
                batch.sum()
        initializer = (_init_child, (str(run),)) if init_in_child else (None, ())
        with ot.log_trace_span("pool"):
            pool = fork.Pool(2, initializer=initializer[0], initargs=initializer[1])
            assert pool.map_async(_work, range(16)).get(timeout=60) == [i * i for i in range(16)]
            pool.close()
            pool.join()  # workers leave through multiprocessing's exit path: their Finalize runs
            for _ in range(pools):
                # Leaving `with Pool` SIGTERMs the workers, which may be anywhere: init, or right after
                # their fork (where a Python-level SIGTERM handler used to lose the signal: a hang).
                with fork.Pool(2, initializer=initializer[0], initargs=initializer[1]) as pool:
                    assert pool.map_async(_work, range(8)).get(timeout=60) == [i * i for i in range(8)]
        ot.shutdown()
        _parent_records_ok(run)
        children = [t for name, t in zip(segments(run), traces(run)) if name.startswith("child.")]
        if not init_in_child:
            assert children == []
            return
        # Workers that leave normally (the DataLoader's, the first pool's) end their files cleanly; a worker
        # that `with Pool` terminated died of SIGTERM at once, as without otel-train (docs/runtime.md): its
        # file holds whole records, in order, up to the kill, and no process_end.
        ended = [t for t in children if t.records and t.records[-1][S.NAME] == S.INSTANT_PROCESS_END]
        assert len(ended) >= 2 + 2, [t.records[-1][S.NAME] for t in children if t.records]
        for trace in children:
            if not trace.records:
                continue  # a terminated pool worker killed before its first record
            if trace in ended:
                assert_clean_end(trace)
            else:
                assert not trace.torn and [r[S.SEQ] for r in trace.records] == list(range(1, len(trace.records) + 1))
            assert len({r[S.PID] for r in trace.records}) == 1 != os.getpid()
        names = {r[S.NAME] for t in children for r in t.records}
        assert {"load", "pool_task", "in_child"} <= names


POOLS = """
import multiprocessing, sys
import otel_train as ot

def init_child(path):
    ot.init(save_path=path, enabled=True, source="child", watchdog=False)

def work(i):
    with ot.log_trace_span("pool_task", i=i):
        return i * i

if __name__ == "__main__":
    run, pools = sys.argv[1], int(sys.argv[2])
    ot.init(save_path=run, enabled=True)
    fork = multiprocessing.get_context("fork")
    for _ in range(pools):
        with fork.Pool(2, initializer=init_child, initargs=(run,)) as pool:
            assert pool.map_async(work, range(8)).get(timeout=60) == [i * i for i in range(8)]
    ot.shutdown()
"""


def test_pools_terminated_while_their_workers_init_never_hang(tmp_path: Path) -> None:
    """`with Pool` SIGTERMs its workers on the way out, often while one is still in init (the other did
    every task). With a SIGTERM handler of ours in the worker that signal was sometimes never acted on,
    and the pool's join waited forever: within 16 – 300 pools beside a busy loop, once in 40 runs of
    this suite. Workers now keep SIGTERM's default action. Run in a child process, so a hang is a
    timeout here, not a stuck suite."""
    import subprocess
    import sys

    pools = trials(150)
    with reported(f"forks: {pools} pools terminated as their workers init", "every pool's join returns", pools):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        try:
            done = subprocess.run([sys.executable, "-c", POOLS, str(tmp_path / "run"), str(pools)], env=env,
                                  capture_output=True, text=True, timeout=60 + pools)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{pools} pools did not end within {60 + pools} s: a terminated worker lived on") from exc
        assert done.returncode == 0, done.stderr[-2000:]
