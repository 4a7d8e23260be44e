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
             "child each child's own file ends cleanly (process_end); no hang")
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
        assert len(children) >= 2 + 2  # both DataLoader workers and the first pool's two workers
        for trace in children:
            if not trace.records:
                continue  # a terminated pool worker killed before its first record
            assert_clean_end(trace)
            assert len({r[S.PID] for r in trace.records}) == 1 != os.getpid()
        names = {r[S.NAME] for t in children for r in t.records}
        assert {"load", "pool_task", "in_child"} <= names
