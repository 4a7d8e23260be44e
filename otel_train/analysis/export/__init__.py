"""Export a run for trace viewers and OTLP backends: ``export(path, fmt, ...)`` (docs/export.md).

The formats are leaves that share only :mod:`.layout`: ``chrome`` (Chrome trace JSON) and ``perfetto``
(Perfetto protobuf) render one process at a time, so a big run is rendered by a pool of workers into
part files that are appended in process order (byte for byte the serial output); ``otlp-json`` streams
the run's SDK spans. Every format is written next to the output and renamed into place.

A step window (``steps``) costs its size (docs/analysis.md, "Reading"): every process is read by
bisection (:mod:`otel_train.analysis.reading.window`), the comm plan (flows, culprits) and the clock
estimate are made from the window's records, and it is rendered in this process unless the window is
big (a window of many processes is planned and read by a pool first, and rendered half here, half by a
forked copy: :data:`WINDOW_POOL_MIN`). A whole-run export uses the read cache (``cache``): the comm
plan takes each process's comm ops from its cached state when it is there (else a byte search of its
files), and each process the export reads whole is kept in the cache for the commands that follow.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO

from otel_train import _modes, schema
from otel_train.analysis.clock import Clock
from otel_train.analysis.export import chrome, perfetto
from otel_train.analysis.export.flows import CommPlan, ProcessMarks, comm_plan, scan_comm
from otel_train.analysis.export.layout import Counts, ProcessLayout, layout_process
from otel_train.analysis.outputs import STDOUT, replacing
from otel_train.analysis.reading import window
from otel_train.analysis.reading.cache import Cache, identify, made, uses
from otel_train.analysis.records import Head, ProcessFiles, Reader, SpanEnd, find_process_files, logs_dir, peek
from otel_train.analysis.summary import default_fr
from otel_train.analysis.pools import beside_a_copy, pool_context
from otel_train.analysis.spans import (PARALLEL_MIN_BYTES, ProcessState, Run, iter_processes, load_run, process_order,
                                       read_process)

FORMATS = ("chrome", "perfetto", "otlp-json")
ANALYSIS_DIR = "analysis"
DEFAULT_NAMES = {"chrome": "structured_trace.json", "perfetto": "structured_trace.pftrace",
                 "otlp-json": "structured_trace.otlp.json"}
_RENDERERS: dict[str, ModuleType] = {"chrome": chrome, "perfetto": perfetto}
"""Formats written one laid-out process at a time: ``HEAD``, then ``render(layout, origin_us, file)`` per
process with ``SEPARATOR`` between them, then ``tail(origin_us, processes, malformed_lines)``. A format
without separators may offer ``Batch(origin_us, file)``, whose ``add(layout)`` returns the counts and
``flush()`` writes what it held: the same bytes as ``render`` per process (perfetto's small processes)."""

Task = tuple[ProcessFiles, int, int, int, "tuple[int, int] | None", str, str, "ProcessMarks | None", "Clock | None",
             bool, "window.Plan | None"]
ONE_PASS_MAX_BYTES = 256 << 20
"""A window of at most this many bytes is read once, in this process: its exported states serve the comm
plan and the rendering (a 10-step window of 1,024 ranks is about 200 MB; the states take ~100 MB)."""
WINDOW_POOL_MIN = 64
"""Processes from which a window's plans and reads go to a pool of workers (one process's window is a
millisecond's work: 1,024 of them, 0.9 s on one core while the others wait)."""
WINDOW_CHUNK = 32
"""Processes a worker takes at a time for a window (fewer round trips than one by one)."""
RAW_TS = "raw_ts"
"""The arg holding a record's own time (Unix s) where the export moved it onto the reference clock."""


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What an export wrote: counts of events by kind, and where."""

    slices: int
    instants: int
    counters: int
    processes: int
    output: Path
    malformed_lines: int = 0
    flows: int = 0  # flow arrows between comm spans (a collective of n members: n - 1; a send -> recv: 1)
    dump_ops: int = 0  # ops read from Flight Recorder dumps
    clock: Clock | None = None  # the hosts' clocks the times were aligned to (docs/clock.md)


def default_output(path: str | Path, fmt: str = "chrome") -> Path:
    """``<run>/analysis/structured_trace.json`` (``.pftrace``, ``.otlp.json``) for a run or logs dir."""
    logs = logs_dir(path)
    run = logs.parent if logs.name == schema.STRUCTURED_LOGS_DIR else logs
    return run / ANALYSIS_DIR / DEFAULT_NAMES[fmt]


def export(
    path: str | Path,
    fmt: str = "chrome",
    output: str | Path | IO[bytes] | None = None,
    *,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
    reader: Reader | None = None,
    workers: int | None = None,
    fr: str | Path | None = None,
    align: bool = True,
    cache: bool = True,
) -> ExportResult:
    """Write the run at ``path`` as ``fmt`` (one of :data:`FORMATS`) to ``output`` (default:
    :func:`default_output`); only ``ranks`` and steps ``lo..hi`` when given. ``fr``: Flight Recorder
    dumps to merge (default: the run's ``fr_dir``, ``<run>/flight_recorder/``, when it exists).
    ``align`` (chrome, perfetto): every host's times on the reference host's clock, estimated from the
    collectives (docs/clock.md), each moved record keeping its own time in its args (``raw_ts``);
    False: the raw clocks. ``cache``: use and fill the run's read cache (see the module doc).

    Raises TraceReadError when ``path`` holds no trace files, ValueError for an unknown format,
    OutputError for an ``output`` that exists and is not a regular file (a device, FIFO, socket,
    directory or link: never replaced). The file is written next to ``output`` and renamed into place,
    so a failed export leaves no torn file; an ``output`` with a ``write`` (stdout) is streamed into.
    ``workers`` (default: CPU count) > 1 renders the processes of a large run in parallel.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(FORMATS)}")
    reader = reader if reader is not None else Reader()
    stream = output if output is not None and hasattr(output, "write") else None
    workers = 1 if stream is not None else workers  # a pool's part files go beside a named output only
    out = Path(STDOUT) if stream is not None else Path(output) if output is not None else default_output(path, fmt)
    origin = trace_origin(path, ranks)
    plan = CommPlan()
    with (contextlib.nullcontext(stream) if stream is not None else replacing(out, "--output")) as f:
        if fmt in _RENDERERS:
            counts, plan = _rendered(path, fmt, f, origin, ranks, fr, reader, align, steps, workers, cache)
        else:
            from otel_train.analysis.export import otlp_json  # the OTel/protobuf stack: only when asked

            counts = otlp_json.write(iter_processes(path, reader, ranks=ranks, steps=steps), f)
    if stream is None:
        made(out)  # a remembered export is served while this file is still the one written (reading/cache.py)
    dump_ops = len(plan.dumps.ops) if plan.dumps is not None else 0
    return ExportResult(*counts, out, reader.malformed_lines, plan.flows, dump_ops, plan.clock)



def _rendered(path: str | Path, fmt: str, f: IO[bytes], origin: float, ranks: set[int] | None, fr: str | Path | None,
              reader: Reader, align: bool, steps: tuple[int, int] | None, workers: int | None, cache: bool
              ) -> tuple[Counts, CommPlan]:
    """A format of :data:`_RENDERERS` written to ``f``: the comm plan, then each process. A small window
    (:data:`ONE_PASS_MAX_BYTES`) is read once: its exported processes' states serve the plan and the
    rendering, here."""
    everyone = process_order(path, None, reader.bad.warn)
    order = [item for item in everyone if ranks is None or item[0].rank in ranks]
    plans = Plans(steps)
    with _window_pool(steps, workers, len(everyone)) as pool:
        plans.fill([pf for pf, _, _ in everyone], pool)
        small = steps is not None and sum(plans.size(pf) for pf, _, _ in order) < ONE_PASS_MAX_BYTES
        run = plan_states(everyone, plans, Cache(logs_dir(path), enabled=cache), reader if small else None,
                          {pf for pf, _, _ in order} if small else set(), workers, pool)
    folder = Path(fr) if fr is not None else default_fr(path, run)
    uses(folder)  # a remembered export depends on the dumps, there or not (reading/cache.py)

    def load() -> Run:
        return load_run(path, warn=_quiet, steps=steps, cache=cache)

    plan = comm_plan(path, order, folder, reader.bad.warn, align, run=run, load=load)
    origin_us = int(_aligned_origin(origin, plan.clock) * 1e6)
    counts = _write_rendered(_RENDERERS[fmt], fmt, order, plan, f, origin_us, reader, steps, workers, cache, plans)
    return counts, plan


class Plans(dict):
    """Each process's window plan (:func:`window.plan`), made once per export (none without ``steps``),
    and the states read already (``read``: a small window's exported processes, ``keep=True``)."""

    def __init__(self, steps: tuple[int, int] | None) -> None:
        super().__init__()
        self.steps = steps
        self.read: dict[ProcessFiles, ProcessState] = {}

    def of(self, pf: ProcessFiles) -> window.Plan | None:
        """The plan of ``pf``'s window (None: no window, or steps that are not monotone: read whole)."""
        if self.steps is None:
            return None
        if pf not in self:
            self[pf] = window.plan(pf, *self.steps)
        return self[pf]  # type: ignore[no-any-return]

    def fill(self, pfs: list[ProcessFiles], pool: Executor | None) -> None:
        """The plans of ``pfs`` made now: by ``pool`` when given (each is a few bisection reads)."""
        todo = [pf for pf in pfs if pf not in self]
        if self.steps is None or not todo:
            return
        if pool is None:
            for pf in todo:
                self.of(pf)
            return
        lo, hi = self.steps
        for pf, got in zip(todo, pool.map(_plan_task, [(pf, lo, hi) for pf in todo], chunksize=WINDOW_CHUNK)):
            self[pf] = got

    def size(self, pf: ProcessFiles) -> int:
        """The bytes of ``pf`` the export reads: its window's, or all of them."""
        plan = self.of(pf)
        return plan.nbytes if plan is not None else pf.size


@contextmanager
def _window_pool(steps: tuple[int, int] | None, workers: int | None, processes: int) -> Iterator[Executor | None]:
    """A pool for a window's plans and reads when it has at least :data:`WINDOW_POOL_MIN` processes
    and more than one worker is allowed; else None (the work is done here)."""
    workers = min(workers or os.cpu_count() or 1, processes)
    if steps is None or workers < 2 or processes < WINDOW_POOL_MIN:
        yield None
        return
    with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        yield pool


def _plan_task(args: tuple[ProcessFiles, int, int]) -> window.Plan | None:
    """Worker: one process's window plan."""
    return window.plan(*args)


def _window_task(args: tuple[ProcessFiles, int, Head | None, window.Plan | None, tuple[int, int], bool]
                 ) -> tuple[ProcessState, int, list[str], int]:
    """Worker: one process's window read (``keep``: its spans too), its bad lines, warnings and bytes
    read (only a kept read's are reported, as here)."""
    pf, attempt, meta, plan, steps, keep = args
    warnings: list[str] = []
    nbytes: list[int] = []
    local = Reader(warn=warnings.append if keep else _quiet, progress=nbytes.append)
    state = read_process(pf, attempt, local, keep=keep, steps=steps, meta=meta, plan=plan)
    state._sinks = state._comm_sinks = {}  # bound appenders: made again on demand, not worth pickling
    return state, local.malformed_lines, warnings, sum(nbytes)


def _window_states(everyone: list[tuple[ProcessFiles, int, Head | None]], plans: Plans, reader: Reader | None,
                   keep: set[ProcessFiles] | frozenset, pool: Executor | None) -> list[ProcessState]:
    """Each process's window read (see :func:`plan_states`): here, or by ``pool``."""
    kept = [pf in keep and reader is not None for pf, _, _ in everyone]
    if pool is None:
        return [read_process(pf, attempt, reader if k else Reader(warn=_quiet), keep=k,  # type: ignore[arg-type]
                             steps=plans.steps, meta=meta, plan=plans.of(pf))
                for (pf, attempt, meta), k in zip(everyone, kept)]
    tasks = [(pf, attempt, meta, plans.of(pf), plans.steps, k) for (pf, attempt, meta), k in zip(everyone, kept)]
    states = []
    for k, (state, malformed, warnings, nbytes) in zip(kept, pool.map(_window_task, tasks, chunksize=WINDOW_CHUNK)):
        if k:
            reader.absorb(malformed, warnings, nbytes)  # type: ignore[union-attr]
        states.append(state)
    return states


def plan_states(everyone: list[tuple[ProcessFiles, int, Head | None]], plans: Plans, store: Cache,
                reader: Reader | None = None, keep: set[ProcessFiles] | frozenset = frozenset(),
                workers: int | None = None, pool: Executor | None = None) -> Run:
    """What the comm plan is made from, for every process of the run (exported or not): with a window,
    each process's window read (its comm ops, groups and mesh; docs/analysis.md, "Reading"; by ``pool``
    when given), those in ``keep`` read whole (``keep=True``, by ``reader``) and kept in ``plans.read``
    for the rendering; else its state in the read cache (``store``) when served exactly, or its comm
    records (a byte search, :func:`scan_comm`)."""
    if plans.steps is not None:
        states = _window_states(everyone, plans, reader, keep, pool)
        for (pf, _, _), state in zip(everyone, states):
            if pf in keep and reader is not None:
                plans.read[pf] = state
        return Run([s for s in states if s.records])
    states: list[ProcessState | None] = []
    for pf, attempt, _meta in everyone:
        hit = store.lookup(pf)
        state = hit.payload[0] if hit is not None and hit.resume is None and isinstance(hit.payload, tuple) else None
        if isinstance(state, ProcessState):
            state.attempt = attempt
        states.append(state if isinstance(state, ProcessState) else None)
    misses = [(i, item) for i, item in enumerate(everyone) if states[i] is None]
    for i, state in zip([i for i, _ in misses], _scanned([item for _, item in misses], workers)):
        states[i] = state
    return Run([s for s in states if s is not None and s.records])


def _scanned(items: list[tuple[ProcessFiles, int, Head | None]], workers: int | None) -> Iterator[ProcessState]:
    """:func:`scan_comm` of each process, in order: by a pool of ``workers`` (default: CPU count)
    processes when there are several and their bytes reach :data:`PARALLEL_MIN_BYTES` (a byte search
    of the whole run, a core's work otherwise while the others wait), else here."""
    workers = min(workers or os.cpu_count() or 1, len(items))
    if workers < 2 or sum(pf.size for pf, _, _ in items) < PARALLEL_MIN_BYTES:
        yield from (scan_comm(*item) for item in items)
        return
    with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        yield from pool.map(_scan_task, items)


def _scan_task(item: tuple[ProcessFiles, int, Head | None]) -> ProcessState:
    """Worker: one process's comm records (:func:`scan_comm`)."""
    return scan_comm(*item)


def _quiet(_message: str) -> None:
    pass


def trace_origin(path: str | Path, ranks: set[int] | None = None) -> float:
    """Earliest Unix time in the run, from the head of each process's oldest segment.

    A span whose start record rotated away starts ``dur_ms`` before its end record, so the first
    records' durations are taken into account.
    """
    best = math.inf
    for pf in find_process_files(path, warn=lambda _msg: None):
        if ranks is not None and pf.rank not in ranks:
            continue
        for rec in peek(pf):
            best = min(best, rec.began() if type(rec) is SpanEnd else rec.ts)
    return 0.0 if best == math.inf else best


def _aligned_origin(origin: float, clock: Clock | None) -> float:
    """The trace's origin at or before every aligned time: a host whose clock is ahead moves back."""
    if clock is None or not clock.applied:
        return origin
    return origin - max(0.0, *(clock.shift(h, origin) for h in clock.hosts))


def align_state(state: ProcessState, clock: Clock | None) -> bool:
    """Move a read process onto the reference clock (spans, instants, counters, its last record),
    each span and instant keeping its own time in ``raw_ts``; False when nothing moves (one host,
    the reference host, a host not estimated, ``--no-align``)."""
    host = state.host
    if clock is None or not clock.applied or host not in clock.hosts or host == clock.reference:
        return False
    at = clock.align
    for span in state.spans:
        raw = span.start_ts
        span.start_ts = at(host, raw)  # type: ignore[assignment]
        span.end_ts = at(host, span.end_ts)
        span.attrs = {**(span.attrs or {}), RAW_TS: raw}
    for rec in state.instants:
        rec.attrs = {**(rec.attrs or {}), RAW_TS: rec.ts}
        rec.ts = at(host, rec.ts)  # type: ignore[assignment]
    for rec in state.scalars:
        rec.ts = at(host, rec.ts)  # type: ignore[assignment]
    state.last_ts = at(host, state.last_ts)
    return True


def _write_rendered(
    renderer: ModuleType,
    fmt: str,
    order: list[tuple[ProcessFiles, int, Head | None]],
    plan: CommPlan,
    f: IO[bytes],
    origin_us: int,
    reader: Reader,
    steps: tuple[int, int] | None,
    workers: int | None,
    cache: bool = True,
    plans: Plans | None = None,
) -> Counts:
    """The whole run, process ``i`` of the run's order with pid ``i + 1``: rendered here (a window of many
    processes read already: in two halves, :func:`_render_halves`), or for a large run (a large window) by
    a pool of workers into part files appended here in order."""
    plans = plans if plans is not None else Plans(steps)
    sizes = [plans.size(pf) for pf, _, _ in order]
    workers = min(workers or os.cpu_count() or 1, len(order))
    f.write(renderer.HEAD)
    totals = Counts(0, 0, 0, 0)
    if plans.read and workers >= 2 and len(order) >= WINDOW_POOL_MIN:  # read already, many: two halves
        totals = _render_halves(_Slice(renderer, order, plan, origin_us, reader, steps, cache, plans), f)
    elif workers < 2 or sum(sizes) < PARALLEL_MIN_BYTES or plans.read:  # read already: rendered here
        totals = _Slice(renderer, order, plan, origin_us, reader, steps, cache, plans).render(0, len(order), f)
    else:
        for counts, part in _pooled(order, sizes, fmt, plan, f, origin_us, reader, steps, workers, cache, plans):
            if totals.processes:
                f.write(renderer.SEPARATOR)
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
            os.unlink(part)
            totals = _add(totals, counts)
    f.write(renderer.tail(origin_us, totals.processes, reader.malformed_lines, clock=plan.clock))
    return totals


def _add(a: Counts, b: Counts) -> Counts:
    return Counts(*(x + y for x, y in zip(a, b)))


@dataclass(frozen=True, slots=True)
class _Slice:
    """What rendering processes of ``order`` here needs (see :func:`_write_rendered`)."""

    renderer: ModuleType
    order: list[tuple[ProcessFiles, int, Head | None]]
    plan: CommPlan
    origin_us: int
    reader: Reader
    steps: tuple[int, int] | None
    cache: bool
    plans: Plans

    def render(self, lo: int, hi: int, f: IO[bytes]) -> Counts:
        """Processes ``order[lo:hi]`` (pids ``lo + 1`` …) laid out and rendered into ``f``, ``SEPARATOR``
        between them, none before the first; their counts."""
        renderer, plans, totals = self.renderer, self.plans, Counts(0, 0, 0, 0)
        batch = renderer.Batch(self.origin_us, f) if hasattr(renderer, "Batch") else None  # small processes together
        for index in range(lo, hi):
            pf, attempt, meta = self.order[index]
            lay = _layout(pf, attempt, index, self.reader, self.steps, meta, self.plan.of(pf.source, pf.rank, attempt),
                          self.plan.clock, self.cache, plans.of(pf), plans.read.pop(pf, None))
            if lay is not None:
                if totals.processes:
                    f.write(renderer.SEPARATOR)
                totals = _add(totals, batch.add(lay) if batch is not None else renderer.render(lay, self.origin_us, f))
        if batch is not None:
            batch.flush()
        return totals


def _render_halves(work: _Slice, f: IO[bytes]) -> Counts:
    """:meth:`_Slice.render` of every process, the second half by a forked copy of this process while
    this one renders the first (a window of 1,024 ranks: 0.7 s of layout and encoding on one core,
    after the pool's reads; :func:`~otel_train.analysis.pools.beside_a_copy`: the read states are
    inherited, never pickled), appended here in order: the bytes of one process rendering them all.
    Without fork (threads running) or when the copy fails, the second half is rendered here."""
    half = len(work.order) // 2
    mine, theirs = beside_a_copy(lambda: work.render(0, half, f), lambda: _into_bytes(work, half, len(work.order)))
    if mine.processes and theirs[0].processes:
        f.write(work.renderer.SEPARATOR)
    f.write(theirs[1])
    return _add(mine, theirs[0])


def _into_bytes(work: _Slice, lo: int, hi: int) -> tuple[Counts, bytes]:
    """:meth:`_Slice.render` of processes ``order[lo:hi]`` into bytes: their counts and the bytes."""
    buffer = io.BytesIO()
    return work.render(lo, hi, buffer), buffer.getvalue()


def _layout(pf: ProcessFiles, attempt: int, index: int, reader: Reader, steps: tuple[int, int] | None,
            meta: Head | None = None, marks: ProcessMarks | None = None, clock: Clock | None = None,
            cache: bool = False, window_plan: window.Plan | None = None, state: ProcessState | None = None
            ) -> ProcessLayout | None:
    """One process read and laid out (None without a valid record), with its comm marks (the ops only a
    dump saw, culprit instants, flows), on the reference clock (``clock``). Only the layout is
    returned: the records are freed before anything is written. ``cache``: a process read whole is
    kept in the read cache (:func:`_read_kept`). ``state``: the process read already."""
    if state is not None:
        pass
    elif cache and steps is None:
        state = _read_kept(pf, attempt, reader, meta)
    else:
        state = read_process(pf, attempt, reader, keep=True, steps=steps, meta=meta, plan=window_plan)
    if not state.records:
        return None
    if marks is not None:
        state.spans.extend(marks.extra_spans)
        state.instants.extend(marks.instants)
    moved = align_state(state, clock)
    lay = layout_process(state, index, marks.spans if marks is not None else None)
    if moved and clock is not None:
        hc = clock.hosts[state.host]  # type: ignore[index]
        lay.labels += f", clock {hc.offset_s * 1e3:+.3f} ms {hc.drift * 1e6:+.1f} ppm aligned to {clock.reference}"
    return lay


def _read_kept(pf: ProcessFiles, attempt: int, reader: Reader, meta: Head | None) -> ProcessState:
    """``read_process(keep=True)`` of the whole process, whose compact part (all but the spans, instants
    and scalars: what ``load_run`` keeps) goes into the read cache, with the read's warnings."""
    store = Cache(logs_dir(pf.paths[0].parent))
    before = [identify(p) for p in pf.paths]
    warnings: list[str] = []
    local = Reader(warn=warnings.append, progress=reader._progress)
    state = read_process(pf, attempt, local, keep=True, meta=meta)
    reader.absorb(local.malformed_lines, warnings, 0)
    kept = (state.spans, state.instants, state.scalars, state._sinks, state._comm_sinks)
    state.spans, state.instants, state.scalars, state._sinks, state._comm_sinks = [], [], [], {}, {}
    state.keep = False
    try:
        store.store(pf, before, (state, warnings))
    finally:
        state.spans, state.instants, state.scalars, state._sinks, state._comm_sinks = kept
        state.keep = True
    return state


def _pooled(
    order: list[tuple[ProcessFiles, int, Head | None]],
    sizes: list[int],
    fmt: str,
    plan: CommPlan,
    f: IO[bytes],
    origin_us: int,
    reader: Reader,
    steps: tuple[int, int] | None,
    workers: int,
    cache: bool = True,
    plans: Plans | None = None,
) -> Iterator[tuple[Counts, str]]:
    """Each process with records, in order: its counts and the part file it was rendered into, by a
    pool of ``workers - 1`` processes and by this one (see :class:`_Schedule`)."""
    stem = str(Path(f.name).with_suffix(".part"))  # type: ignore[attr-defined]
    tasks: list[Task] = [(pf, attempt, index, origin_us, steps, fmt, f"{stem}{index}",
                          plan.of(pf.source, pf.rank, attempt), plan.clock, cache,
                          plans.of(pf) if plans is not None else None) for index, (pf, attempt, _) in enumerate(order)]
    try:
        with ProcessPoolExecutor(workers - 1, mp_context=pool_context()) as pool:
            schedule = _Schedule(pool, tasks, 2 * (workers - 1))  # one running, one waiting per worker
            for index, size in enumerate(sizes):
                counts, malformed, warnings, part = schedule.result(index)
                reader.absorb(malformed, warnings, size)
                if part is not None:
                    yield counts, part
    finally:
        for task in tasks:
            Path(task[6]).unlink(missing_ok=True)


class _Schedule:
    """Render tasks run by a pool and by this process, results taken in task order.

    The pool gets tasks while fewer than ``depth`` of them are waiting or running (two per worker:
    a worker never waits for this process); otherwise this process renders the next task itself. So
    this process is never idle beside the pool, and no more than ``workers`` processes (this one
    included) hold a laid-out process at a time: that bounds the memory of the whole process tree.
    """

    def __init__(self, pool: ProcessPoolExecutor, tasks: list[Task], depth: int) -> None:
        self.pool, self.depth = pool, depth
        self.todo = deque(tasks)
        self.started: dict[int, Future | tuple] = {}

    def result(self, index: int) -> tuple[Counts, int, list[str], str | None]:
        """Task ``index``'s result: while it is not ready, keep the pool fed or render the next task here."""
        while True:
            started = self.started.get(index)
            if isinstance(started, tuple) or (isinstance(started, Future) and started.done()) or not self.todo:
                done = self.started.pop(index)
                return done.result() if isinstance(done, Future) else done  # type: ignore[return-value]
            task = self.todo.popleft()
            queued = sum(isinstance(s, Future) and not s.done() for s in self.started.values())
            self.started[task[2]] = self.pool.submit(_render_task, task) if queued < self.depth else _render_task(task)


def _render_task(task: Task) -> tuple[Counts, int, list[str], str | None]:
    """Worker: read, lay out and render one process into a part file; (counts, malformed, warnings, part)."""
    pf, attempt, index, origin_us, steps, fmt, part, marks, clock, cache, window_plan = task
    warnings: list[str] = []
    reader = Reader(warn=warnings.append)
    lay = _layout(pf, attempt, index, reader, steps, marks=marks, clock=clock, cache=cache, window_plan=window_plan)
    if lay is None:
        return Counts(0, 0, 0, 0), reader.malformed_lines, warnings, None
    with open(_modes.create(part), "wb", buffering=1 << 20) as out:  # 0644 at most, whatever the umask
        counts = _RENDERERS[fmt].render(lay, origin_us, out)
    return counts, reader.malformed_lines, warnings, part
