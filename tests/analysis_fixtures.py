"""Write realistic schema-v1 trace files for analysis tests (what the JSONL sink writes, field for field).

``Proc`` plays one process: it keeps a clock, a stack of open spans and a gapless ``seq``; ``write_run``
lays the processes out as ``<run>/structured_logs/<source>.global_rank_<r>.<stamp>-<rand>.jsonl[.N]``.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from otel_train import schema
from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER, STEP

DEFAULT_PHASES = {DATA_FETCH: 5.0, FORWARD: 20.0, BACKWARD: 40.0, OPTIMIZER: 5.0}


def _plain(value: object) -> object:
    """A numpy scalar (a simulated duration) as the Python number it holds, for msgspec."""
    item = getattr(value, "item", None)
    if item is None:
        raise TypeError(f"cannot encode {type(value).__name__}")
    return item()


_FAST = msgspec.json.Encoder(enc_hook=_plain)


def _finite(value: object) -> bool:
    """No NaN or infinity in ``value`` (json.dumps writes them as NaN, msgspec as null)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def _encode(rec: dict) -> str:
    """One record as the JSONL sink writes it (msgspec, as the runtime's writer); ``json.dumps`` where
    msgspec would change or refuse what a test wrote on purpose: NaN and infinity (hostile-input tests
    write them raw; msgspec writes them as null, so only a record whose line has a null is searched for
    them), a lone surrogate, an int past 64 bits."""
    try:
        line = _FAST.encode(rec)
    except (UnicodeEncodeError, OverflowError, TypeError):
        return json.dumps(rec, separators=(",", ":"))
    if b"null" in line and not _finite(rec):
        return json.dumps(rec, separators=(",", ":"))
    return line.decode()


@dataclass
class Proc:
    """One process attempt writing records; times in ms since ``t0``."""

    rank: int
    world_size: int = 2
    attempt: int = 0
    source: str = "training"
    host: str = "node0"
    pid: int = 0
    t0: float = 1_700_000_000.0
    stamp: str = "20240101-000000"
    rand: str = ""
    lines: list[str] = field(default_factory=list)
    now_ms: float = 0.0
    _stack: list[tuple[str, str, float, int | None]] = field(default_factory=list)
    _seq: int = 0
    _step: int | None = None
    _first_step: int | None = None
    _trace_id: str = field(default_factory=lambda: secrets.token_hex(16))

    def __post_init__(self) -> None:
        self.rand = self.rand or secrets.token_hex(3)
        self.pid = self.pid or 1000 + self.rank + 100 * self.attempt
        self.instant(schema.INSTANT_PROCESS_START)

    @property
    def file_name(self) -> str:
        return schema.trace_file_name(self.source, self.rank, self.stamp, self.rand)

    def _base(self, kind: str, event: str, name: str) -> dict:
        self._seq += 1
        rec = {
            schema.V: schema.SCHEMA_VERSION,
            schema.TS: round(self.t0 + self.now_ms / 1000.0, 6),
            schema.KIND: kind,
            schema.EVENT: event,
            schema.NAME: name,
            schema.TRACE_ID: self._trace_id,
            schema.RANK: self.rank,
            schema.LOCAL_RANK: self.rank % 8,
            schema.WORLD_SIZE: self.world_size,
            schema.HOST: self.host,
            schema.PID: self.pid,
            schema.TID: 1,
            schema.ATTEMPT: self.attempt,
            schema.RUN_ID: "run-1",
            schema.SOURCE: self.source,
            schema.SEQ: self._seq,
            schema.CALLER: "train.py:42:train_loop",
        }
        if self._step is not None:
            rec[schema.STEP] = self._step
            rec[schema.RELATIVE_STEP] = self._step - (self._first_step or 0)
            rec[schema.EPOCH] = 0
        return rec

    def _emit(self, rec: dict) -> None:
        self.lines.append(_encode(rec))

    def advance(self, ms: float) -> None:
        self.now_ms += ms

    def set_step(self, step: int) -> None:
        if self._first_step is None:
            self._first_step = step
        self._step = step

    def start(self, name: str, **attrs: object) -> str:
        sid = secrets.token_hex(8)
        rec = self._base(schema.SPAN_START, name + schema.START_SUFFIX, name)
        rec[schema.SPAN_ID] = sid
        if self._stack:
            rec[schema.PARENT_SPAN_ID] = self._stack[-1][1]
        rec[schema.ATTRS] = dict(attrs)
        self._emit(rec)
        self._stack.append((name, sid, self.now_ms, self._step))
        return sid

    def end(self, status: str = schema.STATUS_OK, error: Mapping[str, str] | None = None) -> None:
        name, sid, started, step = self._stack.pop()
        saved, self._step = self._step, step
        rec = self._base(schema.SPAN_END, name + schema.END_SUFFIX, name)
        self._step = saved
        rec[schema.SPAN_ID] = sid
        if self._stack:
            rec[schema.PARENT_SPAN_ID] = self._stack[-1][1]
        rec[schema.DUR_MS] = round(self.now_ms - started, 3)
        rec[schema.STATUS] = status
        if error is not None:
            rec[schema.ERROR] = dict(error)
        rec[schema.ATTRS] = {}
        self._emit(rec)

    def instant(self, name: str, **attrs: object) -> None:
        rec = self._base(schema.INSTANT, name, name)
        if self._stack:
            rec[schema.SPAN_ID] = self._stack[-1][1]
        rec[schema.ATTRS] = dict(attrs)
        self._emit(rec)

    def scalar(self, values: Mapping[str, float]) -> None:
        rec = self._base(schema.SCALAR, "scalar", "scalar")
        rec[schema.VALUES] = dict(values)
        self._emit(rec)

    def step(self, step: int, phases: Mapping[str, float] | None = None, *, gap_ms: float = 1.0) -> None:
        """A complete training step: a ``step`` span with the given child phases (name -> ms) in order."""
        self.set_step(step)
        self.start(STEP)
        for name, ms in (phases or DEFAULT_PHASES).items():
            self.advance(gap_ms)
            self.start(name)
            self.advance(ms)
            self.end()
        self.advance(gap_ms)
        self.end()

    def steps(self, steps: Iterable[int], phases: Mapping[str, float] | None = None) -> None:
        for s in steps:
            self.step(s, phases)

    def stop_inside(self, step: int, names: Iterable[str]) -> None:
        """Open ``step`` and the given nested phases, leaving them open (a hang or a death inside)."""
        self.set_step(step)
        self.start(STEP)
        for name in names:
            self.advance(1.0)
            self.start(name)
        self.advance(1.0)

    def fail(self, step: int, phase: str, exc_type: str = "RuntimeError", message: str = "boom") -> None:
        """A step whose ``phase`` raises: the phase and the step end with status error."""
        self.set_step(step)
        self.start(STEP)
        self.advance(1.0)
        self.start(phase)
        self.advance(2.0)
        err = {"type": exc_type, "message": message}
        self.end(schema.STATUS_ERROR, err)
        self.end(schema.STATUS_ERROR, err)

    def shutdown(self) -> None:
        """What ``ot.shutdown()`` writes: open spans end as incomplete, then a process_end instant."""
        self.advance(1.0)
        while self._stack:
            self.end(schema.STATUS_INCOMPLETE)
        self.instant(schema.INSTANT_PROCESS_END)


def write_run(
    run_dir: Path,
    processes: Iterable[Proc],
    *,
    lines_per_segment: int | None = None,
    torn_tail: bool = False,
    garbage: Mapping[int, bytes] | None = None,
) -> Path:
    """Write each process's file(s) under ``run_dir/structured_logs``; returns that directory.

    ``lines_per_segment`` rotates like the sink (oldest segment has the highest number);
    ``torn_tail`` cuts the last line of every process in half (a crash mid-write);
    ``garbage`` inserts raw bytes as extra lines before the given line index of every file.
    """
    logs = Path(run_dir) / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    for proc in processes:
        raw = [line.encode() + b"\n" for line in proc.lines]
        if garbage:
            for index in sorted(garbage, reverse=True):
                raw.insert(index, garbage[index] + b"\n")
        if torn_tail and raw:
            raw[-1] = raw[-1][: len(raw[-1]) // 2]
        size = lines_per_segment or max(len(raw), 1)
        segments = [raw[i : i + size] for i in range(0, len(raw), size)] or [[]]
        n = len(segments)
        for i, seg in enumerate(segments):
            suffix = "" if i == n - 1 else f".{n - 1 - i}"
            (logs / (proc.file_name + suffix)).write_bytes(b"".join(seg))
    return logs
