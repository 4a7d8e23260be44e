"""Live diagnosis: follow a run while it is written and name the culprit as it happens (``otel-train watch``).

One state and one set of rules with summarize: every process's files are followed by a
:class:`~otel_train.analysis.records.Tail` and fed into the same
:class:`~otel_train.analysis.spans.ProcessState` summarize builds, and the findings are those of
:func:`~otel_train.analysis.findings.findings`, asked of the live snapshot. What is live-only is the
knowledge of which processes still run, and *when* to ask (docs/watch.md):

* a process has **ended** when it wrote ``process_end``; it is **dead** when its pid is gone on this
  host or, elsewhere, when it wrote nothing, not even a heartbeat, for 3 × ``heartbeat_s``; a process
  on this host that is alive but wrote nothing for that long is **silent** (a thread holds the GIL);
* it is **stalled** when its innermost open span has been open past that name's stall threshold in
  that process (``otel_train.stall``, the watchdog's rule), or the watchdog wrote a ``stall`` for it;
* a group of processes that ran together (source, attempt) is **hung** when none of them closed a
  span for max(``stall_min_s``, ``stall_factor`` × the group's p99 step time so far) and one of them
  stalled. Processes of a hung group, dead ones and ended ones are the snapshot's stopped processes;
  the others are still *running* and no hang or crash is looked for in them;
* findings are asked for when a process appears, ends or dies, an error span appears, or a group
  hangs or moves again; the straggler rule every :data:`STRAGGLERS_EVERY_S` over each running group's
  last :data:`RECENT_STEPS` steps, and once when the group has finished. Each finding is raised once.
  A hang is *resolved* when its culprit closes a span again and its group is no longer hung; a
  straggler when the rule no longer names it;
* the comm graph (docs/comm.md) is kept live too: each poll adds the ops each process closed or
  waits in, so a ``desync`` is raised at the poll that reads the second side of its seq, and a hang
  names the op with the same rules as summarize. Flight Recorder dumps (``fr``) are read again when
  the directory changes (looked at every :data:`FR_POLL_S`).

Thresholds come from each process's own settings (its ``process_start`` record), defaults otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from otel_train import schema
from otel_train.analysis.clock import Clock, estimate, raw_clock
from otel_train.analysis.comm import CommGraph, CommOp, Group, feed_process
from otel_train.analysis.findings import (
    CRASH, DESYNC, ERROR, HANG, RESTART, STRAGGLER, findings, is_collective_failure, straggler_findings,
)
from otel_train.analysis.live_time import OwnTime
from otel_train.analysis.reading.fr_files import fingerprint
from otel_train.analysis.records import (AnyRecord, BadLines, Head, Instant, ProcessFiles, SpanEnd, Tail, TraceReadError, Warn,
                                         head, FORMAT_OURS)
from otel_train.analysis.spans import (STATUS_OPEN, OpenSpan, PhaseSeries, ProcessState, Run, assign_attempts,
                                       choose_run, in_run)
from otel_train.analysis.stacks import clean_stacks
from otel_train.config import Settings
from otel_train.phases import STEP
from otel_train.stall import stall_threshold

STRAGGLERS_EVERY_S = 30.0
"""The straggler rule is asked this often per running group (no single record changes its answer)."""
STRAGGLER_COST_FACTOR = 20.0
"""... or every this many times what asking it took, if that is longer (it costs ~2 ms per rank)."""
RECENT_STEPS = 50
"""The straggler rule looks at a group's last this many steps."""
SPANS_PER_STEP = 16
"""Spans of one name per step the recent-steps view allows for (more: its window holds fewer steps)."""
DEAD_AFTER_HEARTBEATS = 3
"""A process that wrote nothing for this many heartbeat periods is dead (or, on this host and alive, silent)."""
RESTART_GRACE_S = 60.0
"""After every process ended with a failure, how long to wait for the launcher's next attempt when it
said one may come (torchrun's ``TORCHELASTIC_MAX_RESTARTS`` above ``TORCHELASTIC_RESTART_COUNT``)."""
STALL_RECORD_GRACE_S = 2.0
"""How long past a span's threshold to wait for its watchdog's ``stall`` record (it looks every second)."""
PY_SPY_TIMEOUT_S = 10.0
PRUNE_EVERY_OPS = 200_000
"""A live comm graph drops what it needs no more (:meth:`CommGraph.prune`) each time this many more ops came."""
CLOCK_EVERY_S = 5.0
"""The hosts' clocks (docs/clock.md) are estimated again from the live graphs at most this often."""
SKEW_APPLY_S = 0.5
"""A host whose records reach their files this much later (or earlier) than the files' modification
times say is on a clock of its own: its times are compared with watch's own clock shifted by that."""
FR_POLL_S = 5.0
"""How often the Flight Recorder dump directory is looked at for new or changed dumps."""
UNNAMED_HOLD_S = FR_POLL_S + 1.0
"""A hang that names no rank (every waiter's op issued by every member, or ranks that wait for each
other) is raised only once it has been the answer this long, while a process of its attempt still
lives: the views it comes from (each rank's file, each rank's dump, read at different moments) may
still be catching up with a culprit. A run whose processes all ended or died gets it at once."""
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

_OK_END = (schema.STATUS_OK, None)

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Thresholds:
    """A process's watchdog settings (from its ``process_start`` record), which the live rules use too."""

    watchdog: bool
    heartbeat_s: float
    stall_min_s: float
    stall_factor: float

    @classmethod
    def of(cls, settings: Mapping[str, Any] | None) -> Thresholds:
        """From a ``process_start`` record's ``settings``; defaults for what is missing or malformed."""
        base = Settings()
        given = settings if isinstance(settings, Mapping) else {}

        def seconds(key: str, low: float) -> float:
            value = given.get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < float("inf")
            return float(value) if ok else float(getattr(base, key))

        watchdog = given.get("watchdog")
        return cls(watchdog if isinstance(watchdog, bool) else base.watchdog, seconds("heartbeat_s", 0.0),
                   seconds("stall_min_s", 1e-3), seconds("stall_factor", 1.0))

    @property
    def silence_s(self) -> float:
        """No record for this long: dead (elsewhere) or silent (on this host)."""
        return DEAD_AFTER_HEARTBEATS * (self.heartbeat_s or Settings().heartbeat_s)


DEFAULT_THRESHOLDS = Thresholds.of(None)


class HostProbe:
    """Processes on this host: whether a pid still runs, and a py-spy dump of a live one's stacks."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host if host is not None else socket.gethostname()
        beside = Path(sys.executable).with_name("py-spy")  # a venv's bin/ need not be on PATH
        self.py_spy = shutil.which("py-spy") or (str(beside) if beside.is_file() else None)
        self._boot = _boot_time()

    def is_local(self, host: str | None, pid: int | None) -> bool:
        """Whether the process ``pid`` on ``host`` can be probed from here."""
        return bool(pid) and host == self.host

    def alive(self, pid: int, since: float | None = None) -> bool:
        """Whether ``pid`` exists, is not a zombie and, when ``since`` (Unix time) is given, had started
        by then (a later start is another process that reused the pid)."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
            if fields[0] == b"Z":
                return False
            return since is None or self._boot is None or self._boot + int(fields[19]) / _CLK_TCK <= since + 1.0
        except FileNotFoundError:
            return False
        except (OSError, IndexError, ValueError):
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def dump(self, pid: int, first_tid: int | None = None) -> list[dict[str, Any]] | None:
        """Every thread's stack of ``pid`` by ``py-spy dump`` (innermost last), thread ``first_tid`` first,
        then the one holding the GIL; None when py-spy is missing, not permitted, or takes longer than
        :data:`PY_SPY_TIMEOUT_S`."""
        if self.py_spy is None:
            return None
        try:
            done = subprocess.run([self.py_spy, "dump", "--pid", str(pid), "--json", "--full-filenames"],
                                  capture_output=True, timeout=PY_SPY_TIMEOUT_S, check=False)
            threads = json.loads(done.stdout) if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None
        if not isinstance(threads, list):
            return None
        stacks = clean_stacks([_spy_stack(t) for t in threads if isinstance(t, dict)])
        return sorted(stacks, key=lambda s: (s["tid"] != first_tid, not s.get("owns_gil")))


def _boot_time() -> float | None:
    """Unix time this host booted (``btime`` in /proc/stat): process start times count from it."""
    try:
        with open("/proc/stat", "rb") as f:
            return float(next(line.split()[1] for line in f if line.startswith(b"btime ")))
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def _spy_stack(thread: dict[str, Any]) -> dict[str, Any]:
    frames = [f for f in thread.get("frames") or [] if isinstance(f, dict)]
    return {
        "tid": thread.get("os_thread_id") or thread.get("thread_id"),
        "thread": thread.get("thread_name") or "",
        "frames": [f"{f.get('filename')}:{f.get('line')}:{f.get('name')}" for f in reversed(frames)],
        **({"owns_gil": True} if thread.get("owns_gil") else {}),
    }


class LiveProcess:
    """One process instance being followed: its span-model state and what only a live reader knows."""

    __slots__ = ("state", "thresholds", "restarts_left", "progress_ts", "local", "dead", "silent", "gone_at",
                 "_limits", "skew", "_elapsed", "_read", "_child_ends", "own")

    def __init__(self, state: ProcessState, local: bool,
                 elapsed: Callable[[float], float] = lambda now: time.monotonic()) -> None:
        self.state = state
        self.thresholds = DEFAULT_THRESHOLDS
        self.restarts_left = 0  # attempts the launcher may still start after this one
        self.progress_ts: float | None = None  # the last span that closed ok (writer's clock; OwnTime)
        self.own = OwnTime()  # which of its records are trusted as its time (live_time.py)
        self.local = local
        self.dead = self.silent = False
        self.gone_at: float | None = None  # when it ended or died (watch's clock)
        self._limits: dict[str, tuple[int, float]] = {}  # name -> (durations seen, threshold)
        self.skew = 0.0  # watch's clock minus its host's clock, when that host's is off (docs/clock.md)
        self._elapsed = elapsed  # watch's monotonic time (a test's clock: that clock)
        self._read: tuple[float, float] | None = None  # (its clock, watch's elapsed time) at the latest read
        self._child_ends: dict[str, float] = {}  # open span id -> the latest end of a span it parents

    def mark_read(self, now: float, raw: bool = False) -> None:
        """After a read that brought records: where its clock stood then (:meth:`clock`); ``raw``
        (``--no-align``): watch's clock as it is, a writer ahead of it in its future."""
        last = self.own.latest  # its newest record not from the future (live_time.py)
        if last is not None:
            self._read = (now - self.skew if raw else max(last, now - self.skew), self._elapsed(now))

    def clock(self, now: float) -> float:
        """Now on this process's own clock (docs/watch.md, "Clocks"): where it stood at the latest read
        (watch's clock less the host's skew, but never before the newest record: a writer's clock ahead
        of watch's is not in watch's future) plus watch's monotonic time since, so a step of either
        wall clock moves no threshold."""
        if self._read is None:
            return now - self.skew
        at, then = self._read
        return at + (self._elapsed(now) - then)

    @property
    def finished(self) -> bool:
        """Ended through shutdown, or dead."""
        return self.dead or self.state.ended_cleanly

    def take(self, records: list[AnyRecord], warn: Warn | None = None) -> bool:
        """Feed a batch; returns whether it changed what findings could say (an error, the end)."""
        state = self.state
        errors, ended = len(state.errors), state.ended_cleanly
        state.feed(records)
        ahead = self.own.take(records, [r.ts for r in records if type(r) is SpanEnd and r.status in _OK_END])
        self.progress_ts = self.own.progress
        if ahead and warn is not None:  # once per process (live_time.py)
            warn(f"warning: rank {state.rank} (attempt {state.attempt}): {ahead}; not taken as progress")
        self._note_child_ends(records)
        for r in records:
            if type(r) is Instant and r.name == schema.INSTANT_PROCESS_START:
                attrs = r.attrs or {}
                self.thresholds = Thresholds.of(attrs.get("settings"))
                self.restarts_left = _restarts_left(attrs.get("env"))
        return len(state.errors) != errors or state.ended_cleanly != ended

    def _note_child_ends(self, records: list[AnyRecord]) -> None:
        ends, opened = self._child_ends, self.state.opened
        for r in records:
            if type(r) is SpanEnd and r.parent_span_id in opened and ends.get(r.parent_span_id, 0.0) < r.ts <= self.own.limit:
                ends[r.parent_span_id] = r.ts  # type: ignore[index]
        if len(ends) > 2 * len(opened) + 64:
            self._child_ends = {k: v for k, v in ends.items() if k in opened}

    def innermost_since(self, inner: OpenSpan) -> float:
        """When ``inner`` became its thread's innermost open span: the later of its start and the end of
        the last span it parents (the watchdog's rule, docs/watch.md)."""
        return max(inner.start_ts, self._child_ends.get(inner.span_id, 0.0))

    def stalled(self, now: float) -> bool:
        """Whether its innermost open span is past that name's stall threshold in this process, and has
        been the innermost for ``stall_min_s`` (:meth:`innermost_since`; the watchdog's rule).

        A process whose watchdog still writes has the say (its ``stall`` record carries the stacks);
        the same rule computed here decides for one that is silent or runs without a watchdog, and
        for a watchdog that is late by more than :data:`STALL_RECORD_GRACE_S`.
        """
        inner = self.state.innermost
        if inner is None or inner.status != STATUS_OPEN:
            return False
        since, clock = self.innermost_since(inner), self.clock(now)
        if clock - since < self.thresholds.stall_min_s:
            return False
        if self._stall_record(inner, since):
            return True
        return clock - inner.start_ts >= self._threshold(inner.name) + (STALL_RECORD_GRACE_S if self._watched() else 0.0)

    def awaiting_stall_record(self, now: float) -> bool:
        """Whether its watchdog should write the ``stall`` record (and stacks) of its innermost span soon."""
        inner = self.state.innermost
        if inner is None or inner.status != STATUS_OPEN or not self._watched():
            return False
        since = self.innermost_since(inner)
        due = max(inner.start_ts + self._threshold(inner.name), since + self.thresholds.stall_min_s)
        return not self._stall_record(inner, since) and self.clock(now) < due + STALL_RECORD_GRACE_S

    def _stall_record(self, inner: OpenSpan, since: float) -> bool:
        # Its watchdog's stall record since it became innermost: one from before a child ran is over.
        record = self.state.stalls.get(inner.span_id)
        return record is not None and record.ts >= since

    def _watched(self) -> bool:
        # Its watchdog is on and still writes (it is neither silent nor gone).
        return self.thresholds.watchdog and not self.silent and not self.finished

    def _threshold(self, name: str) -> float:
        # Asked every poll while a span is long: worked out again only when the name has new durations.
        series = self.state.phases.get(name)
        seen = len(series.durs) if series is not None else 0
        cached = self._limits.get(name)
        if cached is None or cached[0] != seen:
            count, p99 = _p99_s(series.durs if series is not None else ())
            cached = self._limits[name] = (seen, stall_threshold(count, p99, self.thresholds.stall_min_s,
                                                                 self.thresholds.stall_factor))
        return cached[1]

    def open_for(self, now: float) -> float | None:
        """Seconds its innermost open span has been open."""
        inner = self.state.innermost
        return None if inner is None or self.finished else max(0.0, self.clock(now) - inner.start_ts)

    def status(self, now: float) -> str:
        """ended, dead, silent, stalled or running."""
        if self.state.ended_cleanly:
            return "ended"
        if self.dead:
            return "dead"
        if self.silent:
            return "silent"
        return "stalled" if self.stalled(now) else "running"


def _straggler_work(asks: list[tuple[list[ProcessState], tuple[int, int], CommGraph | None]], order: list[str]
                    ) -> list[dict[str, Any]]:
    return [f for states, window, graph in asks for f in straggler_findings(states, order, window, graph)]


def _recent(state: ProcessState, first_step: int) -> ProcessState:
    """A view of ``state`` with only what the straggler rule reads (phases, parents, host) for steps from
    ``first_step`` on, so asking it costs the same at step 100 and at step 100,000. Only the newest
    ``RECENT_STEPS`` × :data:`SPANS_PER_STEP` spans of a name are looked at (they end in step order)."""
    view = ProcessState(state.source, state.rank, state.attempt, state.instance)
    view.host, view.parents = state.host, state.parents
    tail = RECENT_STEPS * SPANS_PER_STEP
    for name, series in state.phases.items():
        steps = np.frombuffer(series.steps, dtype=np.int64)[-tail:]
        keep = steps >= first_step
        if keep.any():
            durs = np.frombuffer(series.durs, dtype=np.float64)[-tail:]
            ends = np.frombuffer(series.ends, dtype=np.float64)[-tail:]
            view.phases[name] = PhaseSeries(array("q", steps[keep].tobytes()), array("d", durs[keep].tobytes()),
                                            array("d", ends[keep].tobytes()))
    return view


def _restarts_left(env: Any) -> int:
    """Restarts torchrun may still make after this attempt, from the recorded environment."""
    if not isinstance(env, Mapping):
        return 0
    try:
        return max(0, int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    except (TypeError, ValueError):
        return 0


def _p99_s(durs_ms: Iterable[float]) -> tuple[int, float | None]:
    values = np.asarray(durs_ms, dtype=float)
    if not values.size:
        return 0, None
    return int(values.size), float(np.quantile(values, 0.99)) / 1000.0


class LiveRun:
    """The run at ``path`` as it is written: :meth:`poll` reads what is new and returns events.

    Events are ``{"type": "finding" | "resolved", "ts", "finding"}`` (docs/watch.md). ``stacks``:
    add the culprit's stacks to hang and crash findings (its latest stall record, or a py-spy dump of
    a silent process on this host). ``background``: ask the straggler rule in a worker thread (its
    answer comes a poll or more later; ``close()`` stops it). ``align=False`` (``--no-align``): every
    host's raw clock, nothing estimated or shifted (docs/clock.md). ``clock`` and ``probe`` are for tests.
    """

    def __init__(self, path: str | Path, *, warn: Warn | None = None, stacks: bool = False,
                 background: bool = True, probe: HostProbe | None = None,
                 clock: Callable[[], float] = time.time, fr: str | Path | None = None,
                 read_fr: Callable[[Path], tuple[list[CommOp], list[Group]]] | None = None,
                 align: bool = True) -> None:
        self.tail = Tail(Path(path), BadLines(warn))
        self.graphs: dict[tuple[str, int], CommGraph] = {}  # the comm graph of each (source, attempt)
        self._comm_rows: dict[tuple[str, int, str], int] = {}  # comm ops of each process already added
        self._fr = Path(fr) if fr is not None else None
        self._read_fr = read_fr
        self._fr_seen: tuple[Any, ...] | None = None
        self._fr_next = 0.0
        self._fr_data: tuple[list[CommOp], list[Group]] = ([], [])
        self._pruned: dict[tuple[str, int], int] = {}  # graph.ops at each graph's last prune
        self._clock_next = 0.0
        self.align = align
        self._file_clock = align and clock is time.time  # file times are on the real clock, not a test's
        # Watch's own monotonic time, for how long since it read a process (an injected clock is its own).
        self._elapsed: Callable[[float], float] = (lambda now: time.monotonic()) if clock is time.time else (lambda now: now)
        self._clock_ops = -1
        self._host_lag: dict[str | None, float] = {}  # host -> least (file mtime - newest record ts) seen
        self._sizes: dict[tuple[str, int, str], int] = {}  # each process's newest file size at the last read
        self.stacks = stacks
        self.probe = probe if probe is not None else HostProbe()
        self.clock = clock
        self.procs: dict[tuple[str, int, str], LiveProcess] = {}
        self.raised: list[dict[str, Any]] = []  # every finding raised, in order
        self._keys: set[tuple[Any, ...]] = set()
        self._unnamed: dict[Any, float] = {}  # attempt -> when a hang naming no rank was first the answer
        self._active: dict[tuple[Any, ...], tuple[float, dict[str, Any]]] = {}  # hangs and stragglers
        self._pfs: dict[tuple[str, int, str], ProcessFiles] = {}
        self._run: str | None = None  # the run watched, once known (docs/analysis.md, "Several runs in one directory")
        self._other_runs: set[tuple[str, int, str]] = set()  # processes of other runs: not followed
        self._said_runs = False
        self._heads: dict[tuple[str, int, str], Head | None] = {}
        self._hung: set[tuple[str, int]] = set()
        self._run_limits: dict[tuple[str, int], tuple[int, float]] = {}
        self._dirty = False
        self._next_stragglers: dict[tuple[str, int], float] = {}
        self._straggled_final: set[tuple[str, int]] = set()
        self.background = background
        self._pool: ThreadPoolExecutor | None = None
        self._job: tuple[Future[list[dict[str, Any]]], list[tuple[str, int]], float] | None = None

    # -- reading -------------------------------------------------------------------------------

    def poll(self) -> list[Event]:
        """Read what was written since the last poll, update liveness, and return new events."""
        now = self.clock()
        batches = self.tail.poll()
        new = [pf for pf, _ in batches if pf.key not in self.procs and pf.key not in self._other_runs]
        if new:
            self._add(new)
        batches = [(pf, records) for pf, records in batches if pf.key in self.procs]  # not another run's
        for pf, records in batches:
            self._dirty |= self.procs[pf.key].take(records, self.tail.bad.warn)
        self._update_skew(batches)
        for pf, records in batches:
            if records:
                self.procs[pf.key].mark_read(now, raw=not self.align)
        self._dirty |= self._update_comm({pf.key for pf, _ in batches}, now)
        self._update_clock(now)
        self._update_liveness(now)
        return self._evaluate(now)

    def _update_comm(self, keys: set[tuple[str, int, str]], now: float) -> bool:
        """Add what the processes that wrote (``keys``) closed or wait in to their comm graphs, and
        dumps that changed; returns whether a desync appeared (findings must be asked)."""
        desyncs = sum(len(g.desynced) for g in self.graphs.values())
        for key in keys:
            state = self.procs[key].state
            graph = self.graphs.get((state.source, state.attempt))
            if graph is None:
                graph = self.graphs[(state.source, state.attempt)] = CommGraph(source=state.source, attempt=state.attempt)
                for op in self._fr_data[0]:
                    if op.attempt == state.attempt:
                        graph.add(op)
                for group in self._fr_data[1]:
                    graph.add_group(group, replace=False)
            self._comm_rows[key] = feed_process(graph, state, self._comm_rows.get(key, 0))
        for (source, attempt), graph in self.graphs.items():
            if graph.ops - self._pruned.get((source, attempt), 0) >= PRUNE_EVERY_OPS:
                self._pruned[(source, attempt)] = graph.ops
                steps = [lp.state.final_step for lp in self.procs.values()
                         if (lp.state.source, lp.state.attempt) == (source, attempt) and lp.state.final_step is not None]
                if steps:  # kept: the recent steps the straggler rule looks at, and all that is open
                    graph.prune(min(steps) - RECENT_STEPS - 1)
        dumps = self._dumps_changed(now)
        return dumps or sum(len(g.desynced) for g in self.graphs.values()) != desyncs

    def _update_skew(self, batches: list[tuple[ProcessFiles, list[AnyRecord]]]) -> None:
        """Each host's lag: the least, over reads of a file seen growing since the previous read
        (written live: a copied or finished file says nothing of its writer's clock), of its
        modification time (the file system's clock, not the writer's) minus the newest record read
        from it. A host off by more than :data:`SKEW_APPLY_S` gets that as its processes' ``skew``
        (stalls, silence and progress are then judged on its own clock; durations within a process
        need none). Only on the real clock (an injected ``clock`` is a test's: file times do not
        follow it)."""
        changed = set()
        for pf, records in batches if self._file_clock else ():
            if not records or not pf.paths:
                continue
            try:
                st = pf.paths[-1].stat()
            except OSError:
                continue
            before, self._sizes[pf.key] = self._sizes.get(pf.key), st.st_size
            if before is None or st.st_size <= before:
                continue
            lp = self.procs[pf.key]
            host, newest = lp.state.host, lp.own.latest  # not a record from the future (live_time.py)
            lag = st.st_mtime - (newest if newest is not None else max(r.ts for r in records))
            if lag < self._host_lag.get(host, float("inf")):
                self._host_lag[host] = lag
                changed.add(host)
        if changed:
            for lp in self.procs.values():
                lag = self._host_lag.get(lp.state.host, 0.0)
                lp.skew = lag if abs(lag) >= SKEW_APPLY_S else 0.0

    def _update_clock(self, now: float) -> None:
        """The hosts' clocks from the collectives seen so far (docs/clock.md), every
        :data:`CLOCK_EVERY_S` while new ops come: arrivals and "waiting since" compare aligned times."""
        ops = sum(g.ops for g in self.graphs.values())
        if ops == self._clock_ops or now < self._clock_next or not self.graphs:
            return
        self._clock_ops, self._clock_next = ops, now + CLOCK_EVERY_S
        hosts = {lp.state.host for lp in self.procs.values()}
        if not self.align:
            clock = raw_clock()
        elif len(hosts) < 2:
            clock = Clock(reference=next(iter(hosts), None))
        else:
            first = min(self.procs.values(), key=lambda lp: lp.state.rank).state
            starts = [lp.state.first_ts for lp in self.procs.values()
                      if lp.state.host == first.host and lp.state.first_ts]
            clock = estimate(self.graphs.values(), min(starts) if starts else None)
        for graph in self.graphs.values():
            graph.clock = clock

    def _dumps_changed(self, now: float) -> bool:
        """Read the Flight Recorder dumps again when the dump file or folder changed (every FR_POLL_S)."""
        if self._fr is None or self._read_fr is None or now < self._fr_next:
            return False
        self._fr_next = now + FR_POLL_S
        seen = fingerprint(self._fr)  # a file or a folder, listed as the reader lists it (bounded)
        if seen == self._fr_seen:
            return False
        self._fr_seen = seen
        self._fr_data = self._read_fr(self._fr)
        for graph in self.graphs.values():
            for op in self._fr_data[0]:
                if op.attempt == graph.attempt:
                    graph.add(op)
            for group in self._fr_data[1]:
                graph.add_group(group, replace=False)
        return bool(self._fr_data[0])

    @property
    def malformed_lines(self) -> int:
        """Lines skipped so far."""
        return self.tail.malformed_lines

    def _add(self, pfs: list[ProcessFiles]) -> None:
        """Start following processes that appeared (in one go: attempts are numbered over all of them)."""
        for pf in pfs:
            self._heads[pf.key] = head(pf)
        pfs = self._of_run(pfs)
        if not pfs:
            return
        for pf in pfs:
            self._pfs[pf.key] = pf
        attempts = assign_attempts(self._pfs.values(), {p: self._heads[k] for k, p in self._pfs.items()})
        for key, lp in self.procs.items():  # unnumbered restarts are renumbered by start time
            if lp.state.attempt != attempts[self._pfs[key]]:
                self.graphs, self._comm_rows = {}, {}  # the comm graphs are by attempt: made again
            lp.state.attempt = attempts[self._pfs[key]]
        for pf in pfs:
            state = ProcessState.of(pf, attempts[pf], meta=self._heads[pf.key])
            self.procs[pf.key] = LiveProcess(state, self.probe.is_local(state.host, state.pid), self._elapsed)
        self._dirty = True

    def _of_run(self, pfs: list[ProcessFiles]) -> list[ProcessFiles]:
        """The new processes of the run watched (docs/analysis.md, "Several runs in one directory"): the
        one ``--run-id`` names, else the run started last among those present at the first look; the
        others' files are ignored, and a directory seen holding several runs is said once."""
        heads = {pf: self._heads[pf.key] for pf in pfs}
        heads.update({pf: self._heads[key] for key, pf in self._pfs.items()})
        try:
            chosen, note, members = choose_run(heads, self.tail.path, self._run)
        except TraceReadError:  # --run-id names a run that has not written here yet: wait for it
            self._other_runs.update(pf.key for pf in pfs)
            return []
        self._run = chosen
        if note is not None and not self._said_runs:
            self._said_runs = True
            self.tail.bad.warn(note)
        mine = [pf for pf in pfs if in_run(self._heads[pf.key], members, note)]
        self._other_runs.update(pf.key for pf in pfs if pf not in mine)
        return mine

    def _update_liveness(self, now: float) -> None:
        for lp in self.procs.values():
            if lp.finished:
                if lp.gone_at is None:
                    lp.gone_at = now
                continue
            state, th = lp.state, lp.thresholds
            quiet = lp.clock(now) - (lp.own.latest or lp.clock(now))
            if lp.local:
                lp.dead = not self.probe.alive(state.pid, state.first_ts)  # type: ignore[arg-type]
                lp.silent = not lp.dead and quiet >= th.silence_s
            elif th.watchdog and th.heartbeat_s > 0:
                lp.dead = quiet >= th.silence_s
            if lp.dead:
                lp.gone_at, self._dirty = now, True
                lp.dead = state.format == FORMAT_OURS or bool(state.opened)  # torchtitan/pimm: no end record,
                state.ended_cleanly = state.ended_cleanly or not lp.dead  # so gone with no span open is ended

    # -- deciding ------------------------------------------------------------------------------

    def groups(self) -> dict[tuple[str, int], list[LiveProcess]]:
        """Processes that ran together, by (source, attempt), ranks ascending."""
        out: dict[tuple[str, int], list[LiveProcess]] = {}
        for lp in sorted(self.procs.values(), key=lambda p: (p.state.source, p.state.attempt, p.state.rank)):
            out.setdefault((lp.state.source, lp.state.attempt), []).append(lp)
        return out

    def _group_hung(self, group: list[LiveProcess], now: float) -> bool:
        live = [lp for lp in group if not lp.finished]
        if not live:
            return False
        th = live[0].thresholds
        # Each process on its own clock (LiveProcess.clock): the time since the group's latest progress.
        quiet = min(lp.clock(now) - (lp.progress_ts or lp.state.first_ts or lp.clock(now)) for lp in group)
        if quiet < th.stall_min_s:
            return False
        if quiet < self._run_threshold(group, th):
            return False
        return any(lp.stalled(now) for lp in live)

    def _run_threshold(self, group: list[LiveProcess], th: Thresholds) -> float:
        """max(stall_min_s, stall_factor × the group's p99 step time so far), worked out again only when
        the group has new step durations."""
        steps = [lp.state.phases[STEP].durs for lp in group if STEP in lp.state.phases]
        key, seen = (group[0].state.source, group[0].state.attempt), sum(len(d) for d in steps)
        cached = self._run_limits.get(key)
        if cached is None or cached[0] != seen:
            count, p99 = _p99_s(np.concatenate(steps) if steps else ())
            cached = self._run_limits[key] = (seen, stall_threshold(count, p99, th.stall_min_s, th.stall_factor))
        return cached[1]

    def _evaluate(self, now: float) -> list[Event]:
        groups = self.groups()
        hung = {key for key, group in groups.items() if self._group_hung(group, now)}
        if hung != self._hung:  # a group hung, or one that was hung moves again
            self._dirty = True
        self._hung = hung
        running = {lp.state for key, group in groups.items() if key not in hung for lp in group if not lp.finished}
        events = self._resolve_hangs(groups, now)
        if self._dirty:
            self._dirty = False
            alive = {lp.state for lp in self.procs.values() if not lp.dead}
            run = Run([lp.state for lp in self.procs.values()])
            if not self._comm_rows and self.procs:  # graphs dropped (attempts renumbered): made again
                self._update_comm(set(self.procs), now)
            found = findings(run, alive=alive, running=running, stragglers=False, graphs=self.graphs)
            events += self._raise(found, groups, running, now)
        if self._job is None:
            due = [key for key, group in groups.items() if self._straggler_due(key, group, now)]
            if due:
                self._ask_stragglers(groups, due)
        return events + self._straggler_results(groups, running, now)

    def _straggler_due(self, key: tuple[str, int], group: list[LiveProcess], now: float) -> bool:
        """Every :data:`STRAGGLERS_EVERY_S` while the group runs, and once more when it has finished."""
        if all(lp.finished for lp in group):
            if key in self._straggled_final:
                return False
            self._straggled_final.add(key)
            return True
        return now >= self._next_stragglers.get(key, 0.0)

    def _ask_stragglers(self, groups: dict[tuple[str, int], list[LiveProcess]], due: list[tuple[str, int]]) -> None:
        """Ask the straggler rule over each due group's last :data:`RECENT_STEPS` steps, on private
        recent-steps views: in a worker thread (``background``), so reading goes on meanwhile."""
        order = Run([lp.state for lp in self.procs.values()]).phase_order()
        asks = []
        for key in due:
            states = [lp.state for lp in groups[key]]
            last = max((s.final_step for s in states if s.final_step is not None), default=None)
            if last is not None:
                first = last - RECENT_STEPS + 1
                graph = self.graphs.get(key)
                recent = graph.recent(first) if graph is not None and graph.ops else None
                asks.append(([_recent(s, first) for s in states], (first, last), recent))
        work = partial(_straggler_work, asks, order)
        if self.background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="otel-train-stragglers")
            future = self._pool.submit(work)
        else:
            future = Future()
            future.set_result(work())
        self._job = (future, due, time.perf_counter())

    def _straggler_results(self, groups: dict[tuple[str, int], list[LiveProcess]], running: set[ProcessState],
                           now: float) -> list[Event]:
        """Stragglers of a finished ask raised; those it no longer names resolved; the next ask scheduled."""
        if self._job is None or not self._job[0].done():
            return []
        future, due, began = self._job
        self._job = None
        # Its cost grows with the ranks (about 2 ms each): asked less often, it stays near 5 % of a core.
        took = time.perf_counter() - began
        for key in due:
            self._next_stragglers[key] = now + max(STRAGGLERS_EVERY_S, STRAGGLER_COST_FACTOR * took)
        found = future.result()
        current = {_key(f) for f in found}
        events = self._raise(found, groups, running, now)
        judged = {attempt for _, attempt in due}
        for key, (_, f) in list(self._active.items()):
            if f["kind"] == STRAGGLER and f["attempt"] in judged and key not in current:
                events.append(self._resolved(key, now))
        return events

    def close(self) -> None:
        """Stop a straggler ask still running (its result is not wanted any more)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _raise(self, found: list[dict[str, Any]], groups: dict[tuple[str, int], list[LiveProcess]],
               running: set[ProcessState], now: float) -> list[Event]:
        events = []
        for f in found:
            key = _key(f)
            if key in self._keys or self._premature(f, groups, running, now):
                continue
            self._keys.add(key)
            f = self._complete(f, now)
            self.raised.append(f)
            if f["kind"] in (HANG, STRAGGLER):
                self._active[key] = (now, f)
            events.append({"type": "finding", "ts": now, "finding": f})
        return events

    def _premature(self, f: dict[str, Any], groups: dict[tuple[str, int], list[LiveProcess]],
                   running: set[ProcessState], now: float) -> bool:
        """Findings that must wait: a collective failure while its group still runs (its culprit is
        usually another rank, not yet known); a crash that is the echo of a hang already raised; a hang
        that names no rank, for :data:`UNNAMED_HOLD_S`; with
        ``stacks``, a hang whose culprit's watchdog is about to write its stall record (the stacks)."""
        if f["kind"] == ERROR and is_collective_failure("", f["message"]):
            return any(lp.state in running for lp in _of_attempt(groups, f["attempt"]))
        if f["kind"] == CRASH:
            return (HANG, f["attempt"], f["rank"], None) in self._keys
        if f["kind"] == HANG and f.get("rank") is None and any(not lp.finished for lp in _of_attempt(groups, f["attempt"])):
            since = self._unnamed.setdefault(f["attempt"], now)
            if now - since < UNNAMED_HOLD_S:
                self._dirty = True  # ask again at the next poll: a culprit may be named by then
                return True
        if f["kind"] == HANG and self.stacks and "stacks" not in f:
            culprit = self._culprit(f)
            if culprit is not None and culprit.awaiting_stall_record(now):
                self._dirty = True  # ask again at the next poll
                return True
        return False

    def _complete(self, f: dict[str, Any], now: float) -> dict[str, Any]:
        """The finding as watch prints it: victims always, ``since`` for a stop, stacks only when asked."""
        f = {**f, "victims": f.get("victims", [])}
        stacks = f.pop("stacks", None)
        lp = self._culprit(f)
        if f["kind"] in (HANG, CRASH) and lp is not None:
            inner = lp.state.innermost
            f["since"] = inner.start_ts if inner is not None and not lp.state.ended_cleanly else lp.state.last_ts
            if self.stacks and stacks is None and lp.local and lp.silent and not lp.dead:
                stacks = self.probe.dump(lp.state.pid, inner.tid if inner is not None else None)  # type: ignore[arg-type]
        if self.stacks and stacks:
            f["stacks"] = stacks
        return f

    def _culprit(self, f: dict[str, Any]) -> LiveProcess | None:
        matches = [lp for lp in self.procs.values() if lp.state.rank == f["rank"] and lp.state.attempt == f["attempt"]]
        return matches[0] if len(matches) == 1 else None

    def _resolve_hangs(self, groups: dict[tuple[str, int], list[LiveProcess]], now: float) -> list[Event]:
        """Hangs whose group is no longer hung and whose culprit (any rank, for a group-wide one) closed
        a span since it stopped."""
        events = []
        for key, (raised_at, f) in list(self._active.items()):
            if f["kind"] != HANG or any(attempt == f["attempt"] for _, attempt in self._hung):
                continue
            movers = [lp for lp in _of_attempt(groups, f["attempt"]) if f["rank"] is None or lp.state.rank == f["rank"]]
            if any((lp.progress_ts or 0.0) > (f.get("since") or raised_at) and not lp.finished for lp in movers):
                events.append(self._resolved(key, now))
        return events

    def _resolved(self, key: tuple[Any, ...], now: float) -> Event:
        _, f = self._active.pop(key)
        self._keys.discard(key)  # it may be raised again
        return {"type": "resolved", "ts": now, "finding": f}

    # -- the end -------------------------------------------------------------------------------

    def finished(self, now: float | None = None) -> bool:
        """Every process ended or died, and no new attempt is expected: at once, unless the latest
        attempt failed and its launcher may restart it (then up to :data:`RESTART_GRACE_S`)."""
        if not self.procs or self._job is not None or any(not lp.finished for lp in self.procs.values()):
            return False  # (a straggler ask still running has the last word on the stragglers)
        now = self.clock() if now is None else now
        latest = max(lp.state.attempt for lp in self.procs.values())
        last = [lp for lp in self.procs.values() if lp.state.attempt == latest]
        if not any(lp.restarts_left for lp in last):
            return True
        failed = any(f["kind"] in (HANG, CRASH, ERROR) and f["attempt"] == latest for f in self.raised)
        clean = all(lp.state.ended_cleanly for lp in last) and not failed
        return clean or now - max(lp.gone_at or now for lp in last) >= RESTART_GRACE_S

    def rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """One row per process for a live table: rank, attempt, step, open spans, open for, state.

        While a hang (or desync) is active, its culprit's state is ``culprit`` (``culprit (silent)``,
        ``culprit (dead)``) and each victim's ``waiting on <culprit>``, whatever their own state (every
        rank of a hung run is stalled)."""
        now = self.clock() if now is None else now
        blame = self._blame()
        out = []
        for lp in sorted(self.procs.values(), key=lambda p: (p.state.attempt, p.state.rank, p.state.source)):
            s = lp.state
            state = lp.status(now)
            said = blame.get((s.rank, s.attempt)) if state != "ended" else None
            if said is not None:  # a culprit keeps what else is known of it: culprit (silent), (dead)
                state = said if state in ("running", "stalled") or said != "culprit" else f"culprit ({state})"
            out.append({"rank": s.rank, "attempt": s.attempt, "source": s.source, "step": s.final_step,
                        "open": [u.name for u in s.unclosed] if not lp.finished else [],
                        "open_for": lp.open_for(now), "state": state, "host": s.host, "pid": s.pid})
        return out

    def _blame(self) -> dict[tuple[int, int], str]:
        """(rank, attempt) → ``culprit`` or ``waiting on R`` for the active hangs and the desyncs raised."""
        active = [f for _, f in self._active.values()] + [f for f in self.raised if f["kind"] == DESYNC]
        out: dict[tuple[int, int], str] = {}
        for f in active:
            if f["kind"] not in (HANG, DESYNC) or f.get("rank") is None:
                continue
            for victim in f.get("victims") or ():
                out.setdefault((victim, f["attempt"]), f"waiting on {f['rank']}")
            out[(f["rank"], f["attempt"])] = "culprit"
        return out


def _of_attempt(groups: dict[tuple[str, int], list[LiveProcess]], attempt: int | None) -> list[LiveProcess]:
    return [lp for (_, a), group in groups.items() if a == attempt for lp in group]


def _key(f: dict[str, Any]) -> tuple[Any, ...]:
    kind = f["kind"]
    if kind == RESTART:
        return (kind, f["attempt"], f.get("progress"))
    if kind in (ERROR, STRAGGLER):
        return (kind, f["attempt"], f["rank"], f["phase"], f["step"] if kind == ERROR else None)
    return (kind, f["attempt"], f["rank"], None)
