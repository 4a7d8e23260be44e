"""otel_train.analysis.pools: a forked copy does half a job with what this process holds, never pickled."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from otel_train.analysis import pools


@pytest.fixture()
def forking(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forked whatever threads an earlier test left behind (the library itself forks only with one thread).
    monkeypatch.setattr(pools, "pool_context", lambda: multiprocessing.get_context("fork"))


def test_the_copy_answers_from_what_it_inherited(forking: None) -> None:
    """The copy's job is a closure over an object that cannot be pickled (a lock): it runs in another
    process, on what this one held at the fork, and only its answer comes back."""
    held = {"lock": threading.Lock(), "values": list(range(1000))}
    here = os.getpid()
    mine, theirs = pools.beside_a_copy(lambda: (os.getpid(), sum(held["values"][:500])),
                                       lambda: (os.getpid(), sum(held["values"][500:])))
    assert mine == (here, sum(range(500)))
    assert theirs is not None and theirs[0] != here and theirs[1] == sum(range(500, 1000))
    assert pools._INHERITED is None  # nothing held after the job


def test_a_copy_that_fails_has_its_job_done_here(forking: None) -> None:
    here = os.getpid()

    def killed_in_the_copy() -> int:
        if os.getpid() != here:
            raise MemoryError("the copy was killed")
        return os.getpid()

    assert pools.beside_a_copy(lambda: 1, killed_in_the_copy) == (1, here)
    assert pools._INHERITED is None


def test_without_fork_nothing_is_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that runs other threads never forks (they could deadlock the copy): both jobs run here,
    ``theirs`` after ``mine``."""
    monkeypatch.setattr(pools, "pool_context", lambda: multiprocessing.get_context("forkserver"))
    ran: list[tuple[str, int]] = []
    assert pools.beside_a_copy(lambda: ran.append(("mine", os.getpid())) or 1,
                               lambda: ran.append(("theirs", os.getpid())) or 2) == (1, 2)
    assert ran == [("mine", os.getpid()), ("theirs", os.getpid())] and not pools.can_fork()


def test_an_error_of_my_half_is_raised_here(forking: None) -> None:
    def broken() -> int:
        raise ValueError("mine")

    with pytest.raises(ValueError, match="mine"):
        pools.beside_a_copy(broken, lambda: 2)
    assert pools._INHERITED is None


def test_the_pool_context_forks_only_a_process_of_one_thread() -> None:
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait)
    extra.start()
    try:
        assert pools.pool_context().get_start_method() != "fork"
    finally:
        stop.set()
        extra.join()
