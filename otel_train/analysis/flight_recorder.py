"""PyTorch Flight Recorder dumps read as comm ops (docs/comm.md, "Flight Recorder dumps").

A dump is what ``torch._C._distributed_c10d._dump_fr_trace()`` (pickle) or ``_dump_fr_trace_json()``
(JSON) returns, or what Flight Recorder writes itself on a timeout (``TORCH_FR_DUMP_TEMP_FILE`` +
rank): a dict with ``entries`` (one per op the process issued, oldest first), ``pg_config`` (each
group's name, desc and member ranks, where the backend fills it) and ``pg_status``.

The rules, each in one place below:

* **files**: a file or a directory, listed and read by :mod:`otel_train.analysis.reading.fr_files`
  (regular files only, never a link met while listing, :data:`FR_MAX_DEPTH` folder levels,
  :data:`MAX_DUMP_BYTES` per file): a dump path may be the one a trace file names;
* **format** by the first byte: ``\\x80`` a pickle, ``{`` JSON, anything else is skipped with one line.
  A pickle is loaded by :class:`SafeUnpickler`, which builds builtin containers and scalars only: the
  first global (a class, a function such as ``os.system``) refuses the whole file, in one line;
* **rank**: the dump's own ``rank`` field, else the number after ``rank`` in the file name
  (``rank_3.json``, ``host-a.rank3.pkl``, ``nccl_trace_rank_3``), else the last number in the name
  (torch's ``<prefix><rank>``, ``fr_trace_7``), taken only below the run's ``world_size`` (else
  :data:`~otel_train.analysis.fr_entries.MAX_RANKS`): a larger one skips the file; **attempt**: the dump's ``attempt``, else the number
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
* **total**: every value is checked before use (:mod:`otel_train.analysis.fr_entries`); an odd one is
  skipped and counted (``odd_values``, one line per file), work per dump is capped, and a file that
  fails in any way costs only itself;
* ranks that belong to the world (0 .. the highest rank seen, the members of every known group,
  ``world_size``; all below the bound above) but have no dump are *missing*: named, never fatal.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_train.analysis.comm import CommOp, Group
from otel_train.analysis.fr_entries import (
    DEFAULT_PG, MAX_ENTRIES, MAX_RANKS, Odd, groups_of, number, ops_of, text,
)
from otel_train.analysis.reading.fr_files import FR_MAX_DEPTH, MAX_DUMP_BYTES, list_dumps, read_dump

Warn = Callable[[str], None]

__all__ = ["FR_MAX_DEPTH", "MAX_DUMP_BYTES", "FlightRecorderDumps", "Incident", "RefusedPickle", "SafeUnpickler",
           "read_dumps", "safe_loads"]

MAX_FILE_LINES = 50
"""Warning lines about single files (skipped, refused, odd values) said per read; the rest are counted
in one line, so a folder of 100,000 files that are no dumps costs no flood."""
_STATE_ORDER = {"scheduled": 0, "started": 1, "completed": 2}
_RANK_IN_NAME = re.compile(r"rank[_\-.]?([0-9]+)", re.IGNORECASE | re.ASCII)
_ATTEMPT_IN_PATH = re.compile(r"attempt[_\-.]?([0-9]{1,6})(?![0-9])", re.IGNORECASE | re.ASCII)
_NUMBER = re.compile(r"[0-9]+", re.ASCII)
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
    odd_values: int = 0  # values skipped in the dumps read (the files' warnings say which first)
    file_lines: int = 0  # warning lines about single files (the first MAX_FILE_LINES said, the rest counted)


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
    """Every Flight Recorder dump under ``path`` (a file, or a directory read :data:`FR_MAX_DEPTH`
    levels deep): never raises, whatever the files hold.

    A file that is no readable dump is skipped with one line to ``warn`` (and in ``warnings``); a
    path that does not exist gives an empty result. ``world_size`` and ``groups`` (e.g. the trace's
    ``comm.group`` instants) tell which ranks should have a dump; a rank at or past ``world_size``
    (else :data:`MAX_RANKS`) is no rank of the run.
    """
    out = FlightRecorderDumps()
    say, per_file = _sayer(out, warn)
    bound = min(world_size, MAX_RANKS) if world_size and world_size > 0 else MAX_RANKS
    for group in groups:
        out.groups.setdefault(group.group, group)
    per_process: dict[tuple[int, int], list[tuple[float, list[CommOp]]]] = {}
    expected: set[int] = set()  # ranks named by damaged dumps: still of the world
    for file, follow in _dump_files(Path(path), out, per_file, say):
        try:
            read = _read_one(file, follow, bound, out, per_file)
        except Exception as exc:  # noqa: BLE001 - one bad dump never costs the good ones
            read = None
            per_file(f"warning: {file}: skipped (not readable as a dump: {type(exc).__name__})")
        if not isinstance(read, tuple):
            out.skipped.append(file)
            if read is not None:
                expected.add(read)
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
    if out.file_lines > MAX_FILE_LINES:
        say(f"warning: {path}: {out.file_lines - MAX_FILE_LINES} more warnings about single files not shown")
    _place_world(out, expected, world_size, bound, say)
    return out


def _place_world(out: FlightRecorderDumps, expected: set[int], world_size: int | None, bound: int, say: Warn) -> None:
    """The ranks with no readable dump, and the default group of dumps without ``pg_config``."""
    out.missing = _missing(out.ranks, expected, out.groups.values(), world_size, bound)
    world = tuple(sorted(out.ranks.union(out.missing)))
    for name, group in out.groups.items():  # gloo's dumps have no pg_config: the default group is the world
        if group.desc == DEFAULT_PG and not group.ranks and world:
            out.groups[name] = Group(group.group, group.desc, world)
    if out.missing:
        say(f"warning: Flight Recorder: no dump for rank{'s' if len(out.missing) > 1 else ''} "
            f"{_spans(out.missing)}")


def _spans(ranks: list[int]) -> str:
    """``0, 2-5, 9``: sorted ranks as runs."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _sayer(out: FlightRecorderDumps, warn: Warn | None) -> tuple[Warn, Warn]:
    """One line to ``warn`` and ``warnings``; and the same for lines about single files, the first
    :data:`MAX_FILE_LINES` of them (the rest counted in ``file_lines``)."""
    def say(line: str) -> None:
        out.warnings.append(line)
        if warn is not None:
            warn(line)

    def per_file(line: str) -> None:
        out.file_lines += 1
        if out.file_lines <= MAX_FILE_LINES:
            say(line)
    return say, per_file


def _dump_files(path: Path, out: FlightRecorderDumps, per_file: Warn, say: Warn) -> list[tuple[Path, bool]]:
    """The regular files under ``path`` (:func:`list_dumps`; each with whether it may be a link: only
    the path given); what is not a regular file is named and skipped unopened."""
    listing = list_dumps(path)
    for file, why in listing.refused:
        out.skipped.append(file)
        per_file(f"warning: {file}: skipped unopened ({why}, not a Flight Recorder dump)")
    for note in listing.notes:
        say(f"warning: {path}: {note}")
    return [(file, listing.top_is_file) for file in listing.files]


def _read_one(file: Path, follow: bool, bound: int, out: FlightRecorderDumps, say: Warn
              ) -> tuple[Incident, list[CommOp], list[Group], float] | int | None:
    """One file: its incident, ops, groups and newest entry time; else (said why) the rank a damaged
    dump's name gives, or None."""
    data, why, dumpish = read_dump(file, follow=follow)
    dump, fmt = (None, "") if data is None else _decode(file, data, say)
    if dump is None:
        if data is None:
            say(f"warning: {file}: skipped ({why})")
        named = _rank_of(file, {}, bound, Odd())[0] if dumpish else None
        return named
    odd = Odd()
    rank, reason = _rank_of(file, dump, bound, odd)
    if rank is None:
        say(f"warning: {file}: skipped ({reason})")
        return None
    attempt = _attempt_of(file, dump, odd)
    entries = dump["entries"]
    if len(entries) > MAX_ENTRIES:
        say(f"warning: {file}: only the newest {MAX_ENTRIES} of its {len(entries)} entries read")
        entries = entries[-MAX_ENTRIES:]
    groups = groups_of(dump, entries, odd, bound)
    ops, skipped_names = ops_of(dump, entries, rank, attempt, groups, odd)
    if skipped_names:
        say(f"warning: {file}: skipped entries of unknown ops: {', '.join(sorted(skipped_names))}")
    if odd.count:
        out.odd_values += odd.count
        say(f"warning: {file}: {odd.count} odd value{'s' if odd.count > 1 else ''} skipped (first: {odd.first}); "
            "the rest of the dump read")
    newest = max((op.start for op in ops if op.start is not None), default=0.0)
    version = text(dump.get("version"), odd, "version")
    incident = Incident(file, rank, attempt, fmt, len(ops), version)
    return incident, ops, list(groups.values()), newest


def _decode(file: Path, data: bytes, say: Warn) -> tuple[dict | None, str]:
    """The dump dict and its format, or (None, "") after one line saying why not."""
    try:
        if data[:1] == b"\x80":
            fmt, dump = "pickle", safe_loads(data)
        else:
            fmt, dump = "json", json.loads(data)
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


def _rank_of(file: Path, dump: dict, bound: int, odd: Odd) -> tuple[int | None, str]:
    """The dump's own ``rank``, else the number the name gives; (None, why) when there is none within
    the world (0 .. ``bound`` - 1)."""
    own = number(dump.get("rank"), odd, "rank", high=1 << 64) if "rank" in dump else None
    if own is None:
        name = file.name
        for suffix in _SUFFIXES:
            if name.lower().endswith(suffix):
                name = name[: -len(suffix)]
                break
        found = _RANK_IN_NAME.findall(name) or _NUMBER.findall(name)
        if not found:
            return None, "no rank in the dump or in its name"
        own = int(found[-1]) if len(found[-1]) <= 9 else 1 << 64
    if own < bound:
        return own, ""
    shown = str(own) if own < 1 << 64 else "a number past 2**64"
    return None, f"rank {shown} is outside the run's world of {bound} rank{'s' if bound > 1 else ''}"


def _attempt_of(file: Path, dump: dict, odd: Odd) -> int:
    own = number(dump.get("attempt"), odd, "attempt", high=1 << 20)
    if own is not None:
        return own
    found = _ATTEMPT_IN_PATH.findall(str(file))
    return int(found[-1]) if found else 0


def _missing(ranks: set[int], expected: set[int], groups: Iterable[Group], world_size: int | None,
             bound: int) -> list[int]:
    """Ranks of the world (0 .. the highest rank seen, ``world_size``, every group's members; all
    below ``bound``) with no readable dump."""
    if not ranks and not expected:
        return []
    world = set(range(max(ranks | expected) + 1))
    if world_size:
        world.update(range(min(world_size, bound)))
    for group in groups:
        world.update(r for r in group.ranks if type(r) is int and 0 <= r < bound)
    return sorted(world - ranks)


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
