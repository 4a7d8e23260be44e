"""PyTorch Flight Recorder, from inside the traced process (docs/comm.md, "Flight Recorder").

* :func:`configure` at ``ot.init``: sets ``TORCH_FR_BUFFER_SIZE`` when no process group exists yet
  and the user set none (the buffer size is read when a group is created), and
  ``TORCH_FR_DUMP_TEMP_FILE`` to a prefix under ``fr_dir`` that names this process's attempt and
  start, so torch's own dump on a timeout lands where the CLI reads it and never overwrites an
  earlier incident. What it found goes into ``process_start`` (``attrs.comm``).
* :class:`BufferReader`: the recorder's thread reads the in-process buffer (the pickle
  ``_dump_fr_trace`` without stacks: measured cheaper than the JSON one) only when a group's op
  counter shows ops no wrapper saw, at most once per :data:`MIN_READ_INTERVAL_S` (longer when a read
  costs more, so reading stays under 2 % of a core), and hands on only the entries not seen before.
* :func:`write_dump`: an in-process JSON dump with the rank, attempt and a timestamp in its name (a
  new file each time), written when the watchdog reports a stall in a ``comm.*`` span.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import msgspec

from otel_train import _report
from otel_train import schema as S

ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"
ENV_BUFFER_OLD = "TORCH_NCCL_TRACE_BUFFER_SIZE"
ENV_DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"
ENV_DUMP_PREFIX_OLD = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
BUFFER_SIZE = 2000
MIN_READ_INTERVAL_S = 0.75
MAX_READ_INTERVAL_S = 5.0
MAX_READ_SHARE = 0.02
"""A read that took d seconds of CPU waits at least d / MAX_READ_SHARE before the next one."""
STOPPED_READ_SHARE = 0.05
"""A read for a rank that stopped issuing ops (it may wait in its last one, docs/comm.md) comes as soon as
the previous read's cost allows at this share of a core (d / STOPPED_READ_SHARE after it)."""
MAX_STALL_DUMPS = 20



def buffer_size_from_env() -> int:
    for var in (ENV_BUFFER, ENV_BUFFER_OLD):
        text = os.environ.get(var, "").strip()
        if text:
            try:
                return int(text)
            except ValueError:
                return 0
    return 0


def configure(fr_dir: str, rank: int, attempt: int, enabled_recording: bool) -> dict[str, Any]:
    """Set the Flight Recorder's environment for groups created from now on; returns ``process_start``'s
    ``comm`` object: ``{"flight_recorder": bool, "buffer_size", "reason" (when off), "dump_prefix"}``."""
    status: dict[str, Any] = {}
    initialised = _initialised()
    user_size = os.environ.get(ENV_BUFFER, os.environ.get(ENV_BUFFER_OLD, "")).strip()
    if not user_size and not initialised:
        os.environ[ENV_BUFFER] = str(BUFFER_SIZE)
    size = buffer_size_from_env()
    status["flight_recorder"] = size > 0
    status["buffer_size"] = size
    if size <= 0:
        status["reason"] = (
            f"{ENV_BUFFER}={user_size} set by the user" if user_size else
            "init_process_group ran before otel_train.init, so its groups have no Flight Recorder buffer: "
            f"set {ENV_BUFFER}={BUFFER_SIZE} in the environment or call otel_train.init first; "
            "DDP's reducer is recorded through otel_train.torch.instrument's comm hook")
    elif initialised and not user_size:
        status["reason"] = "a process group existed before otel_train.init"
    prefix = os.environ.get(ENV_DUMP_PREFIX) or os.environ.get(ENV_DUMP_PREFIX_OLD)
    if not prefix:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        prefix = os.path.join(fr_dir, f"torch.attempt_{attempt}.{stamp}.{os.getpid()}.rank_")
        os.environ[ENV_DUMP_PREFIX] = prefix
    status["dump_prefix"] = prefix
    status["recording"] = enabled_recording
    return status


def _initialised() -> bool:
    import sys

    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return bool(c10d is not None and c10d.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def _dump_pickle() -> bytes:
    from torch._C import _distributed_c10d as C

    return C._dump_fr_trace(True, False, False)


class BufferReader:
    """Reads the in-process buffer when asked and due; yields entries newer than the last read, plus
    the entries that were still running at an earlier read (to see them end)."""

    def __init__(self) -> None:
        self.enabled = buffer_size_from_env() > 0
        self.reads = 0
        self.cpu_s = 0.0
        self._next_at = 0.0
        self._read_at = 0.0
        self._last_record = -1
        self._cost = 0.0

    def due(self, now: float) -> bool:
        return self.enabled and now >= self._next_at

    def due_when_stopped(self, now: float) -> bool:
        return self.enabled and now >= self._read_at + self._cost / STOPPED_READ_SHARE

    def read(self, now: float) -> list[dict[str, Any]]:
        """Entries with a record id above the last read's (oldest first); [] when the buffer is empty."""
        cpu0 = time.thread_time()
        try:
            dump = pickle.loads(_dump_pickle())
        except Exception as exc:  # noqa: BLE001 - an older torch, a backend without the buffer
            self.enabled = False
            _report.report_exception("reading the Flight Recorder buffer (ops issued from C++ are not recorded)", exc)
            return []
        entries = dump.get("entries") or []
        cost = time.thread_time() - cpu0
        self.reads += 1
        self.cpu_s += cost
        # Paced by the smoothed cost, the first read left out (it pays one-time setup inside torch).
        self._cost = cost if self.reads == 2 else (0.7 * self._cost + 0.3 * cost if self.reads > 2 else 0.0)
        self._next_at = now + min(MAX_READ_INTERVAL_S, max(MIN_READ_INTERVAL_S, self._cost / MAX_READ_SHARE))
        self._read_at = now
        return entries

    def new(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last = self._last_record
        fresh = [e for e in entries if e.get("record_id", -1) > last]
        if entries:
            self._last_record = max(last, max(e.get("record_id", -1) for e in entries))
        return fresh


def entry_op(entry: dict[str, Any]) -> str | None:
    """The ``comm.*`` op of a collective entry; None for p2p, coalesced markers and unknown names."""
    if entry.get("is_p2p"):
        return None
    name = str(entry.get("profiling_name") or "")
    return S.FR_OP_NAMES.get(name.rsplit(":", 1)[-1].lower())


def entry_bytes(entry: dict[str, Any]) -> tuple[int, str | None]:
    total, dtype = 0, None
    for sizes, type_name in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        name, size = S.FR_ELEMENT_BYTES.get(str(type_name).lower(), (str(type_name).lower(), 0))
        dtype = dtype or name
        count = 1
        for dim in sizes:
            count *= int(dim)
        total += count * size
    return total, dtype


def entry_done(entry: dict[str, Any]) -> bool:
    return bool(entry.get("retired")) or entry.get("state") == "completed"


class StallDumps:
    """Writes an in-process JSON dump for a stalled ``comm.*`` span (the watchdog's thread)."""

    def __init__(self, fr_dir: str, rank: int, attempt: int, world_size: int) -> None:
        self._dir = fr_dir
        self._rank, self._attempt, self._world = rank, attempt, world_size
        self.written: list[str] = []

    def on_stall(self, name: str) -> None:
        if not name.startswith("comm.") or len(self.written) >= MAX_STALL_DUMPS or buffer_size_from_env() <= 0:
            return
        try:
            self.written.append(write_dump(self._dir, self._rank, self._attempt, self._world, reason=f"stall in {name}"))
        except Exception as exc:  # noqa: BLE001 - a dump is a help, never a fault of training
            _report.report_exception("writing a Flight Recorder dump for a stalled op", exc)


def write_dump(fr_dir: str, rank: int, attempt: int, world_size: int, *, reason: str) -> str:
    """One JSON dump of this process's buffer, in a new file; returns its path."""
    from torch._C import _distributed_c10d as C

    dump = msgspec.json.decode(C._dump_fr_trace_json())
    dump.update(rank=rank, attempt=attempt, world_size=world_size, reason=reason, written_ns=time.time_ns())
    os.makedirs(fr_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = os.path.join(fr_dir, f"stall.attempt_{attempt}.{stamp}.{n}.rank_{rank}.json")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.json.encode(dump))
        return path
    raise FileExistsError(f"1000 dumps named {stamp} already in {fr_dir}")
