"""PyTorch Flight Recorder dumps read as comm ops (docs/comm.md, "Flight Recorder dumps").

A dump is what ``torch._C._distributed_c10d._dump_fr_trace()`` (pickle) or ``_dump_fr_trace_json()``
(JSON) returns, or what Flight Recorder writes itself on a timeout (``TORCH_FR_DUMP_TEMP_FILE`` +
rank): a dict with ``entries`` (one per op the process issued, oldest first), ``pg_config`` (each
group's name, desc and member ranks, where the backend fills it) and ``pg_status``.

The rules, each in one place below:

* **format** by the first byte: ``\\x80`` a pickle, ``{`` JSON, anything else is skipped with one line.
  A pickle is loaded by :class:`SafeUnpickler`, which builds builtin containers and scalars only: the
  first global (a class, a function such as ``os.system``) refuses the whole file, in one line;
* **rank**: the dump's own ``rank`` field, else the number after ``rank`` in the file name
  (``rank_3.json``, ``host-a.rank3.pkl``, ``nccl_trace_rank_3``), else the last number in the name
  (torch's ``<prefix><rank>``, ``fr_trace_7``); **attempt**: the dump's ``attempt``, else the number
  after ``attempt`` in the path, else 0;
* **every file is an incident**: several dumps of one rank are all read; their ops are one list per
  (rank, attempt), an op seen in two incidents once (by group, seq, op and peer), with the state of
  the incident that saw it furthest along (completed > started > scheduled; a tie: the later dump);
* **an entry is a** :class:`CommOp`: the op from ``profiling_name`` (:data:`otel_train.schema.FR_OP_NAMES`), group = the
  group's name (``process_group[0]``, what ``ProcessGroup.group_name`` gives and what the trace's
  ``comm.group`` holds), seq = ``collective_seq_id``, for send/recv the per-pair count in the dump's
  entry order (1 for the first send to a peer); bytes = the input tensors' elements × element size;
  start = ``time_created_ns`` (when the rank issued the op); end = ``time_discovered_completed_ns``
  when set, else the start when the op is known to be done (state ``completed``, ``retired``, or an
  ``op_id`` up to the group's ``last_completed_collective``: gloo never sets the times), else None (the
  rank waits in it);
* ranks that belong to the world (0 .. the highest rank seen, the members of every known group,
  ``world_size``) but have no dump are *missing*: named, never fatal.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_train import schema
from otel_train.analysis.comm import SOURCE_FR, CommOp, Group

Warn = Callable[[str], None]

MAX_DUMP_BYTES = 512 << 20
"""A file bigger than this is no dump we read (2,000 entries with stacks are a few MB)."""

DEFAULT_PG = "default_pg"
COALESCED = "coalesced"
"""An entry that stands for a batch of ops recorded on their own: not an op of its own."""


_STATE_ORDER = {"scheduled": 0, "started": 1, "completed": 2}
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE)
_ATTEMPT_IN_PATH = re.compile(r"attempt[_\-.]?(\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")
_SUFFIXES = (".pkl", ".pickle", ".json", ".pk", ".bin", ".txt")


@dataclass(frozen=True, slots=True)
class Incident:
    """One dump file read: whose it is, its format, how many ops it gave."""

    path: Path
    rank: int
    attempt: int
    format: str  # "pickle" | "json"
    ops: int
    version: str | None = None


@dataclass(slots=True)
class FlightRecorderDumps:
    """Every dump under a path, read (see the module doc)."""

    ops: list[CommOp] = field(default_factory=list)
    groups: dict[str, Group] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    missing: list[int] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)


class RefusedPickle(pickle.UnpicklingError):
    """A pickle asked for something other than builtin containers and scalars."""


class SafeUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, sets, strings, bytes, numbers, bools and None; refuses any global
    (class, function, extension code) and persistent id, so no code named by the file ever runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedPickle(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("persistent id")


def safe_loads(data: bytes) -> Any:
    """``pickle.loads`` restricted to builtin containers and scalars (:class:`SafeUnpickler`)."""
    return SafeUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------------------------------------
# Reading


def read_dumps(path: str | Path, *, warn: Warn | None = None, world_size: int | None = None,
               groups: Iterable[Group] = ()) -> FlightRecorderDumps:
    """Every Flight Recorder dump under ``path`` (a file or a directory, read recursively).

    A file that is no readable dump is skipped with one line to ``warn`` (and in ``warnings``); a
    path that does not exist gives an empty result. ``world_size`` and ``groups`` (e.g. the trace's
    ``comm.group`` instants) tell which ranks should have a dump.
    """
    out = FlightRecorderDumps()
    say = _sayer(out, warn)
    for group in groups:
        out.groups.setdefault(group.group, group)
    per_process: dict[tuple[int, int], list[tuple[float, list[CommOp]]]] = {}
    expected: set[int] = set()  # ranks named by files that could not be read: still of the world
    for file in _dump_files(Path(path)):
        read = _read_one(file, say)
        if read is None:
            out.skipped.append(file)
            named = _rank_of(file, {})
            if named is not None:
                expected.add(named)
            continue
        incident, ops, dump_groups, newest = read
        out.incidents.append(incident)
        out.ranks.add(incident.rank)
        for group in dump_groups:
            known = out.groups.get(group.group)
            if known is None or (not known.ranks and group.ranks):
                out.groups[group.group] = group
        per_process.setdefault((incident.rank, incident.attempt), []).append((newest, ops))
    for key in sorted(per_process):
        out.ops.extend(_merge_incidents(per_process[key]))
    out.missing = _missing(out.ranks, expected, out.groups.values(), world_size)
    world = tuple(sorted(out.ranks.union(out.missing)))
    for name, group in out.groups.items():  # gloo's dumps have no pg_config: the default group is the world
        if group.desc == DEFAULT_PG and not group.ranks and world:
            out.groups[name] = Group(group.group, group.desc, world)
    if out.missing:
        say(f"warning: Flight Recorder: no dump for rank{'s' if len(out.missing) > 1 else ''} "
            f"{', '.join(map(str, out.missing))}")
    return out


def _sayer(out: FlightRecorderDumps, warn: Warn | None) -> Warn:
    def say(line: str) -> None:
        out.warnings.append(line)
        if warn is not None:
            warn(line)
    return say


def _dump_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(Path(root, n) for n in sorted(names) if not n.startswith("."))
    return files


def _read_one(file: Path, say: Warn) -> tuple[Incident, list[CommOp], list[Group], float] | None:
    """One file: its incident, ops, groups and newest entry time; None (said why) when it is no dump."""
    try:
        size = file.stat().st_size
        if size > MAX_DUMP_BYTES:
            say(f"warning: {file}: skipped ({size} bytes: bigger than any Flight Recorder dump)")
            return None
        data = file.read_bytes()
    except OSError as exc:
        say(f"warning: {file}: cannot read ({exc.strerror or exc}); skipped")
        return None
    dump, fmt = _decode(file, data, say)
    if dump is None:
        return None
    rank = _rank_of(file, dump)
    if rank is None:
        say(f"warning: {file}: skipped (no rank in the dump or in its name)")
        return None
    attempt = _attempt_of(file, dump)
    groups = _groups(dump)
    ops, skipped_names = _ops(dump, rank, attempt, groups)
    if skipped_names:
        say(f"warning: {file}: skipped entries of unknown ops: {', '.join(sorted(skipped_names))}")
    newest = max((op.start for op in ops if op.start is not None), default=0.0)
    version = dump.get("version")
    incident = Incident(file, rank, attempt, fmt, len(ops), str(version) if version is not None else None)
    return incident, ops, list(groups.values()), newest


def _decode(file: Path, data: bytes, say: Warn) -> tuple[dict | None, str]:
    """The dump dict and its format, or (None, "") after one line saying why not."""
    start = data.lstrip()[:1]
    try:
        if data[:1] == b"\x80":
            fmt, dump = "pickle", safe_loads(data)
        elif start == b"{":
            fmt, dump = "json", json.loads(data)
        else:
            say(f"warning: {file}: skipped (neither a pickle nor JSON: not a Flight Recorder dump)")
            return None, ""
    except RefusedPickle as exc:
        say(f"warning: {file}: refused ({exc}: a Flight Recorder dump holds only builtin containers and scalars)")
        return None, ""
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, RecursionError, OverflowError) as exc:
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        say(f"warning: {file}: skipped (truncated or corrupt: {reason})")
        return None, ""
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        say(f"warning: {file}: skipped (no 'entries' list: not a Flight Recorder dump)")
        return None, ""
    return dump, fmt


def _rank_of(file: Path, dump: dict) -> int | None:
    own = dump.get("rank")
    if type(own) is int and own >= 0:
        return own
    name = file.name
    for suffix in _SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    found = _RANK_IN_NAME.findall(name)
    if found:
        return int(found[-1])
    numbers = _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def _attempt_of(file: Path, dump: dict) -> int:
    own = dump.get("attempt")
    if type(own) is int and own >= 0:
        return own
    found = _ATTEMPT_IN_PATH.findall(str(file))
    return int(found[-1]) if found else 0


def _groups(dump: dict) -> dict[str, Group]:
    """The dump's groups from ``pg_config`` (gloo leaves it empty), then the names its entries use."""
    out: dict[str, Group] = {}
    config = dump.get("pg_config")
    for key, value in (config.items() if isinstance(config, dict) else ()):
        if not isinstance(value, dict):
            continue
        name = str(value.get("name") or key)
        if name:
            out[name] = Group(name, str(value.get("desc") or ""), _member_ranks(value.get("ranks")))
    for entry in dump["entries"]:
        pg = entry.get("process_group") if isinstance(entry, dict) else None
        if isinstance(pg, (list, tuple)) and len(pg) == 2 and str(pg[0]) not in out:
            out[str(pg[0])] = Group(str(pg[0]), str(pg[1]), ())
    return out


def _member_ranks(value: Any) -> tuple[int, ...]:
    """``pg_config`` ranks: a list, or its text (``"[0, 1]"``); () when unknown."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return ()
    if isinstance(value, (list, tuple)) and all(type(r) is int for r in value):
        return tuple(value)
    return ()


def _missing(ranks: set[int], expected: set[int], groups: Iterable[Group], world_size: int | None) -> list[int]:
    if not ranks and not expected:
        return []
    world = set(range(max(ranks | expected) + 1))
    if world_size:
        world.update(range(world_size))
    for group in groups:
        world.update(group.ranks)
    return sorted(world - ranks)


# ---------------------------------------------------------------------------------------------
# Entries -> ops


def _ops(dump: dict, rank: int, attempt: int, groups: dict[str, Group]) -> tuple[list[CommOp], set[str]]:
    """The dump's entries as ops (in entry order) and the op names it did not know."""
    done_up_to = _completed_op_ids(dump.get("pg_status"))
    pairs: dict[tuple[str, int, str], int] = {}  # (group, peer, send|recv) -> count so far
    ops: list[CommOp] = []
    unknown: set[str] = set()
    for entry in dump["entries"]:
        if not isinstance(entry, dict):
            continue
        op, peer = _op_and_peer(entry.get("profiling_name"), rank, unknown)
        if op is None:
            continue
        pg = entry.get("process_group")
        group = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(entry.get("pg_id", ""))
        if peer is not None:
            members = groups[group].ranks if group in groups else ()
            peer = members[peer] if 0 <= peer < len(members) else peer  # group rank -> global rank
            key = (group, peer, op)
            seq = pairs[key] = pairs.get(key, 0) + 1
        else:
            seq = _int(entry.get("collective_seq_id"))
        ops.append(_op_of(entry, rank, attempt, group, seq, op, peer, done_up_to.get(group)))
    return ops, unknown


def _op_and_peer(profiling_name: Any, rank: int, unknown: set[str]) -> tuple[str | None, int | None]:
    """``gloo:all_reduce`` -> (all_reduce, None); ``nccl:send 0->1`` -> (send, 1); ``nccl:recv 1<-0``
    -> (recv, 0) (group ranks); an unknown name is added to ``unknown``."""
    if not isinstance(profiling_name, str):
        return None, None
    name = profiling_name.split(":", 1)[-1].strip()
    head, _, meta = name.partition(" ")
    if head.lower() == COALESCED:
        return None, None
    op = schema.FR_OP_NAMES.get(head.lower())
    if op is None:
        unknown.add(head[:60] or "''")
        return None, None
    peer = None
    if op in ("send", "recv") and meta:
        sides = re.split(r"->|<-", meta.strip())
        if len(sides) == 2 and all(s.strip().isdigit() for s in sides):
            peer = int(sides[1])
    return op, peer


def _op_of(entry: dict, rank: int, attempt: int, group: str, seq: int, op: str, peer: int | None,
           done_up_to: int | None) -> CommOp:
    created = _ns(entry.get("time_created_ns"))
    completed = _ns(entry.get("time_discovered_completed_ns"))
    state = str(entry.get("state") or "scheduled")
    op_id = _int(entry.get("op_id"), -1)
    done = (state == "completed" or entry.get("retired") is True
            or (done_up_to is not None and 0 <= op_id <= done_up_to) or completed is not None)
    end = completed if completed is not None else created
    nbytes, dtype = _size(entry)
    thread = entry.get("thread_id")
    tid = int(thread) if isinstance(thread, (int, str)) and str(thread).isdigit() else None
    return CommOp(rank, attempt, group, seq, op, created, end if done else None, peer, nbytes, dtype,
                  tid=tid, state="completed" if done else state, source=SOURCE_FR)


def _completed_op_ids(status: Any) -> dict[str, int]:
    """``pg_status``: each group's ``last_completed_collective`` (an op id; -1 or missing: none)."""
    out: dict[str, int] = {}
    for group, value in (status.items() if isinstance(status, dict) else ()):
        if isinstance(value, dict):
            done = _int(value.get("last_completed_collective"), -1)
            if done >= 0:
                out[str(group)] = done
    return out


def _size(entry: dict) -> tuple[int | None, str | None]:
    """Bytes of the input tensors (the output's where an op has no input) and the first dtype."""
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not sizes and entry.get("output_sizes"):
        sizes, dtypes = entry.get("output_sizes"), entry.get("output_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list):
        return None, None
    if not sizes:
        return 0, None
    total = 0
    names = []
    for shape, dtype in zip(sizes, dtypes):
        known = schema.FR_ELEMENT_BYTES.get(str(dtype).lower())
        if known is None or not isinstance(shape, list) or not all(type(d) is int for d in shape):
            return None, str(dtype).lower() if dtype is not None else None
        names.append(known[0])
        total += math.prod(shape) * known[1]
    return total, names[0] if names else None


def _ns(value: Any) -> float | None:
    """Unix nanoseconds -> seconds; 0 and None (not recorded) -> None."""
    number = _int(value)
    return number / 1e9 if 0 < number < 1 << 63 else None


def _int(value: Any, default: int = 0) -> int:
    if type(value) is int:
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return default


def _merge_incidents(incidents: list[tuple[float, list[CommOp]]]) -> list[CommOp]:
    """One process's ops over all its dumps: each op once, from the incident that saw it furthest
    along (a tie: the later dump), in issue order (start, then entry order)."""
    best: dict[tuple[str, int, str, int | None], tuple[int, float, CommOp]] = {}
    for newest, ops in incidents:
        for op in ops:
            key = (op.group, op.seq, op.op, op.peer)
            rank = (_STATE_ORDER.get(op.state, 0), newest)
            seen = best.get(key)
            if seen is None or rank >= seen[:2]:
                best[key] = (*rank, op)
    return sorted((v[2] for v in best.values()), key=lambda op: op.start or 0.0)
