"""Processes that share an analysis's work: the pools' start method, and a forked copy for half a job.

* :func:`pool_context`: fork when this process runs one thread (cheapest: the workers inherit what is
  loaded), else forkserver (forking a process that runs other threads can deadlock them).
* :func:`beside_a_copy`: one job here while a forked copy of this process does another, with what this
  process holds inherited at the fork, never pickled (a large run's graph, its read states). Only the
  copy's answer comes back. Without fork, or when the copy fails, that job is done here after the other.

The pools' modules (``concurrent.futures``, ``multiprocessing``) are imported where a pool starts: a
small read never pays for them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import multiprocessing.context

Mine = TypeVar("Mine")
Theirs = TypeVar("Theirs")

_INHERITED: Callable[[], Any] | None = None
"""The forked copy's job: set just before the fork, called there (see :func:`beside_a_copy`)."""


def pool_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for analysis pools."""
    import multiprocessing

    # fork is cheapest, but forking a process that runs other threads can deadlock them.
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if os.name == "posix" else "spawn")


def can_fork() -> bool:
    """Whether :func:`beside_a_copy` would fork: a second CPU, and fork safe here (:func:`pool_context`)."""
    return (os.cpu_count() or 1) >= 2 and pool_context().get_start_method() == "fork"


def beside_a_copy(mine: Callable[[], Mine], theirs: Callable[[], Theirs]) -> tuple[Mine, Theirs]:
    """``mine()`` here while a forked copy of this process runs ``theirs()``; both answers. Without a
    copy (fork not safe here: :func:`pool_context`) or when it fails (killed for memory, broken),
    ``theirs()`` runs here after ``mine()``. An exception of ``mine`` is raised here as usual."""
    global _INHERITED
    context = pool_context()
    if context.get_start_method() != "fork":
        return mine(), theirs()
    from concurrent.futures import ProcessPoolExecutor

    _INHERITED = theirs
    try:
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            other = pool.submit(_run_inherited)
            here = mine()
            try:
                return here, other.result()
            except Exception:  # noqa: BLE001 - a copy killed (memory) or broken: its job is done here, below
                pass
    finally:
        _INHERITED = None
    return here, theirs()


def _run_inherited() -> Any:
    """In the forked copy: the job :data:`_INHERITED` held at the fork."""
    assert _INHERITED is not None
    return _INHERITED()
