"""What ``ot.init`` starts and ``ot.shutdown`` stops: one process's communication recording (docs/comm.md)."""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Callable

from otel_train import _report
from otel_train import context as step_context
from otel_train.comm import flight_recorder as fr
from otel_train.comm.groups import GroupTable
from otel_train.comm.notes import NoteQueue

C10D = "torch.distributed.distributed_c10d"
CLOSED_FEED_MAX = 1 << 16
"""Ended spans the recorder has not taken yet (it takes them every look); beyond, the oldest go."""


class CommSession:
    """One ``init``'s recording: settings checked at init, patches and the thread started, undone at stop."""

    def __init__(self, *, mode: str, fr_dir: str, rank: int, attempt: int, world_size: int,
                 tracer: Any, instant: Callable[[str, dict[str, Any]], None],
                 open_entries: Callable[[], list[Any]] | None,
                 closed_feed: Callable[[Any], None] | None = None, arrival: Any = None, ids: Any = None) -> None:
        self.mode = mode
        self.recording = mode != "off"
        self.status = fr.configure(fr_dir, rank, attempt, self.recording)
        self.stall_dumps = fr.StallDumps(fr_dir, rank, attempt, world_size)
        self._tracer, self._instant, self._open_entries = tracer, instant, open_entries
        self._closed_feed = closed_feed  # installs (or, given None, removes) the deque of spans that ended
        self._arrival = arrival  # the JSONL processor's: an op's start record on the issuing thread
        self._ids = ids  # the runtime's id generator: the herald's ids become the spans' ids
        self.queue = NoteQueue()
        self.groups = GroupTable()
        self.recorder: Any = None
        self.patches: Any = None
        self._after_import: Any = None
        self._mesh_undo: Callable[[], None] | None = None

    def start(self) -> None:
        if not self.recording:
            return
        if C10D in sys.modules:
            self._attach()
        else:
            from otel_train.comm.imports import AfterImport

            self._after_import = AfterImport(C10D, self._attach).install()

    def _attach(self) -> None:
        """Patch torch.distributed and start the thread (now, or when torch.distributed is imported)."""
        from otel_train.comm import mesh
        from otel_train.comm.herald import make_herald
        from otel_train.comm.patch import NoteMaker, Patches
        from otel_train.comm.recorder import Recorder

        buffer = fr.BufferReader()
        closed = None
        if self._closed_feed is not None and self._open_entries is not None and buffer.enabled:
            closed = deque(maxlen=CLOSED_FEED_MAX)
            self._closed_feed(closed)
        herald = make_herald(self._ids, self._arrival, self._instant)
        self.recorder = Recorder(self._tracer, self.queue, self.groups, instant=self._instant,
                                 open_entries=self._open_entries, buffer=buffer, closed=closed, herald=herald)
        self.recorder.baseline()
        self.patches = Patches(NoteMaker(self.queue, self.groups, herald), before_destroy=self.recorder.flush)
        self.status["patched"] = self.patches.install()
        self._mesh_undo = mesh.detect_meshes()
        step_context.step_listeners.append(self.recorder.on_step)
        self.recorder.start()

    def stop(self) -> None:
        if self._after_import is not None:
            self._after_import.remove()
        if self._mesh_undo is not None:
            _quietly(self._mesh_undo)
        if self.patches is not None:
            _quietly(self.patches.remove)
        if self._closed_feed is not None:
            _quietly(lambda: self._closed_feed(None))  # type: ignore[misc]
        if self.recorder is not None:
            if self.recorder.on_step in step_context.step_listeners:
                step_context.step_listeners.remove(self.recorder.on_step)
            _quietly(self.recorder.stop)
        # Ops still running were written as open spans: their notes (and Works) go now, and the groups: a
        # wrapper that outlives the session (a module took it) must not keep them alive (comm/patch.py).
        from otel_train.comm.patch import PENDING

        PENDING.clear()
        self.groups.forget(None)

    def on_stall(self, name: str) -> None:
        """The watchdog wrote a stall for span ``name``: a Flight Recorder dump when it is a comm op."""
        self.stall_dumps.on_stall(name)


def check_available(mode: str) -> str | None:
    """Why ``collectives=on`` cannot be honoured here (None when it can, or for another mode)."""
    if mode != "on":
        return None
    try:
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - torch missing or broken
        return f"torch.distributed cannot be imported ({_report.describe(exc)})"
    if not dist.is_available():
        return "this torch build has no torch.distributed (torch.distributed.is_available() is False)"
    return None


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        _report.report_exception(f"stopping the comm recorder ({getattr(fn, '__qualname__', fn)})", exc)
