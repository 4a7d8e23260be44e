"""A Flight Recorder dump's entries as comm ops, total and bounded (docs/comm.md, "Flight Recorder dumps").

:mod:`otel_train.analysis.flight_recorder` reads the files; this module turns one decoded dump into
:class:`~otel_train.analysis.comm.CommOp` rows by the rules in that module's doc. A dump is data from
outside: every value is checked for its type and range before it is used, and one that fails (a
``'²'`` where a number belongs, ``'--5'``, a 5,000-digit number, ``nccl:send 0->²``, a group name
that is a list nested 200,000 deep) is skipped and counted in :class:`Odd`, never passed to ``int``,
``str`` or ``repr`` whole. Work is bounded per dump: at most :data:`MAX_ENTRIES` entries (the newest),
:data:`MAX_GROUPS` groups, :data:`MAX_TENSORS` tensors of :data:`MAX_DIMS` dimensions per entry and
:data:`MAX_NUMBERS` shape numbers in all; sizes past 2**63 bytes are odd values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import islice
from typing import Any

from otel_train import schema
from otel_train.analysis.comm import SOURCE_FR, CommOp, Group

MAX_RANKS = 1 << 17
"""The largest world a dump's ranks are taken from when the run's ``world_size`` is unknown (131,072
ranks: larger than any job run so far); a rank at or past the world's size is no rank of the run."""
MAX_ENTRIES = 1 << 18
"""Entries read per dump (the newest; torch keeps 2,000 by default, ``TORCH_FR_BUFFER_SIZE``)."""
MAX_GROUPS = 1 << 16
"""``pg_config`` and ``pg_status`` items read per dump."""
MAX_TENSORS = 1 << 12
"""Tensors per entry whose sizes are counted (an all_gather into a list has one per rank)."""
MAX_DIMS = 64
"""Dimensions of one tensor's shape (torch allows 64 at most)."""
MAX_NUMBERS = 1 << 23
"""Shape numbers looked at per dump in all; past it, sizes are unknown (and counted)."""
MAX_TEXT = 1024
"""The longest group name, description, op name or dtype taken from a dump."""
_LIMIT = 1 << 63
DEFAULT_PG = "default_pg"
COALESCED = "coalesced"
"""An entry that stands for a batch of ops recorded on their own: not an op of its own."""
_INTEGER = re.compile(r"-?[0-9]{1,19}", re.ASCII)
_PEERS = re.compile(r"\s*([0-9]{1,9})\s*(?:->|<-)\s*([0-9]{1,9})\s*", re.ASCII)


class Odd:
    """Odd values met in one dump: how many, the first (described, never printed whole), and what is
    left of the dump's shape-number budget."""

    __slots__ = ("count", "first", "numbers")

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None
        self.numbers = MAX_NUMBERS

    def __call__(self, where: str, value: Any) -> None:
        self.count += 1
        if self.first is None:
            self.first = f"{where}: {describe(value)}"


def describe(value: Any) -> str:
    """A short, safe description of any value (a huge integer or a deep list is never formatted)."""
    if isinstance(value, str):
        return repr(value[:40]) + ("…" if len(value) > 40 else "")
    if type(value) is int:
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if type(value) is float:
        return repr(value)
    return f"a {type(value).__name__}"


def number(value: Any, odd: Odd, where: str, low: int = 0, high: int = _LIMIT) -> int | None:
    """An integer (or its decimal text) in [``low``, ``high``); None when absent; anything else is odd."""
    if value is None:
        return None
    if type(value) is str and _INTEGER.fullmatch(value):
        value = int(value)
    if type(value) is int and low <= value < high:
        return value
    odd(where, value)
    return None


def text(value: Any, odd: Odd, where: str) -> str | None:
    """A name: a string of at most :data:`MAX_TEXT` characters, or a small integer as text; None when
    absent or empty; anything else is odd."""
    if value is None or value == "":
        return None
    if type(value) is str and len(value) <= MAX_TEXT:
        return value
    if type(value) is int and -_LIMIT <= value < _LIMIT:
        return str(value)
    odd(where, value)
    return None


def groups_of(dump: dict, entries: list, odd: Odd, bound: int) -> dict[str, Group]:
    """The dump's groups from ``pg_config`` (gloo leaves it empty), then the names its entries use."""
    out: dict[str, Group] = {}
    for key, value in _items(dump.get("pg_config"), odd, "pg_config"):
        if not isinstance(value, dict):
            odd("pg_config", value)
            continue
        name = text(value.get("name"), odd, "pg_config name") or text(key, odd, "pg_config key")
        if name:
            desc = text(value.get("desc"), odd, "pg_config desc") or ""
            out[name] = Group(name, desc, member_ranks(value.get("ranks"), odd, bound))
    seen = Odd()  # an entry's odd group is counted once, where the entry is read (ops_of)
    for entry in entries:
        pg = entry.get("process_group") if isinstance(entry, dict) else None
        if isinstance(pg, (list, tuple)) and len(pg) == 2:
            name = text(pg[0], seen, "process_group")
            if name and name not in out:
                out[name] = Group(name, text(pg[1], seen, "process_group desc") or "", ())
    return out


def _items(value: Any, odd: Odd, where: str) -> Iterable[tuple[Any, Any]]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        odd(where, value)
        return ()
    if len(value) > MAX_GROUPS:
        odd(where, f"{len(value)} items")
    return islice(value.items(), MAX_GROUPS)


def member_ranks(value: Any, odd: Odd, bound: int) -> tuple[int, ...]:
    """``pg_config`` ranks: a list, or its text (``"[0, 1]"``), every rank within the world; () when
    unknown or odd."""
    if value is None:
        return ()
    if type(value) is str and len(value) <= 16 * bound:
        import json

        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            odd("pg_config ranks", value)
            return ()
    if isinstance(value, (list, tuple)) and len(value) <= bound and all(
            type(r) is int and 0 <= r < bound for r in value):
        return tuple(value)
    odd("pg_config ranks", value if not isinstance(value, (list, tuple)) else f"{len(value)} ranks, not all in the world")
    return ()


def completed_op_ids(status: Any, odd: Odd) -> dict[str, int]:
    """``pg_status``: each group's ``last_completed_collective`` (an op id; -1 or missing: none)."""
    out: dict[str, int] = {}
    for group, value in _items(status, odd, "pg_status"):
        name = text(group, odd, "pg_status key")
        if name is not None and isinstance(value, dict):
            done = number(value.get("last_completed_collective"), odd, "last_completed_collective", low=-1)
            if done is not None and done >= 0:
                out[name] = done
    return out


def ops_of(dump: dict, entries: list, rank: int, attempt: int, groups: dict[str, Group], odd: Odd
           ) -> tuple[list[CommOp], set[str]]:
    """The entries as ops (in entry order) and the op names not known; an entry with an odd value where
    its identity (op, group, seq, peer) belongs is skipped, an odd time or size is left unknown."""
    done_up_to = completed_op_ids(dump.get("pg_status"), odd)
    pairs: dict[tuple[str, int, str], int] = {}  # (group, peer, send|recv) -> count so far
    ops: list[CommOp] = []
    unknown: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            odd("entry", entry)
            continue
        before = odd.count
        op, peer = op_and_peer(entry.get("profiling_name"), unknown, odd)
        group = _group_of(entry, odd)
        seq = number(entry.get("collective_seq_id"), odd, "collective_seq_id")
        if op is None or group is None or odd.count != before:
            continue
        if peer is not None:
            members = groups[group].ranks if group in groups else ()
            peer = members[peer] if 0 <= peer < len(members) else peer  # group rank -> global rank
            key = (group, peer, op)
            seq = pairs[key] = pairs.get(key, 0) + 1
        ops.append(_op_of(entry, rank, attempt, group, seq or 0, op, peer, done_up_to.get(group), odd))
    return ops, unknown


def _group_of(entry: dict, odd: Odd) -> str | None:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return "" if type(pg[0]) is str and not pg[0] else text(pg[0], odd, "process_group")
    pg_id = number(entry.get("pg_id"), odd, "pg_id")
    return "" if pg_id is None else str(pg_id)


def op_and_peer(profiling_name: Any, unknown: set[str], odd: Odd) -> tuple[str | None, int | None]:
    """``gloo:all_reduce`` -> (all_reduce, None); ``nccl:send 0->1`` -> (send, 1); ``nccl:recv 1<-0``
    -> (recv, 0) (group ranks); an unknown name is added to ``unknown``; ``send 0->²`` is odd."""
    name = text(profiling_name, odd, "profiling_name")
    if name is None:
        return None, None
    name = name.split(":", 1)[-1].strip()
    head, _, meta = name.partition(" ")
    if head.lower() == COALESCED:
        return None, None
    op = schema.FR_OP_NAMES.get(head.lower())
    if op is None:
        unknown.add(head[:60] or "''")
        return None, None
    if op not in ("send", "recv") or not meta.strip():
        return op, None
    sides = _PEERS.fullmatch(meta)
    if sides is None:
        odd("profiling_name", profiling_name)
        return None, None
    return op, int(sides.group(2))


def _op_of(entry: dict, rank: int, attempt: int, group: str, seq: int, op: str, peer: int | None,
           done_up_to: int | None, odd: Odd) -> CommOp:
    created = _ns(entry.get("time_created_ns"), odd, "time_created_ns")
    completed = _ns(entry.get("time_discovered_completed_ns"), odd, "time_discovered_completed_ns")
    state = text(entry.get("state"), odd, "state") or "scheduled"
    op_id = number(entry.get("op_id"), odd, "op_id", low=-1)
    done = (state == "completed" or entry.get("retired") is True
            or (done_up_to is not None and op_id is not None and 0 <= op_id <= done_up_to) or completed is not None)
    end = completed if completed is not None else created
    nbytes, dtype = size_of(entry, odd)
    tid = number(entry.get("thread_id"), odd, "thread_id")
    return CommOp(rank, attempt, group, seq, op, created, end if done else None, peer, nbytes, dtype,
                  tid=tid, state="completed" if done else state, source=SOURCE_FR)


def _ns(value: Any, odd: Odd, where: str) -> float | None:
    """Unix nanoseconds -> seconds; 0 and None (not recorded) -> None."""
    ns = number(value, odd, where)
    return ns / 1e9 if ns else None


def size_of(entry: dict, odd: Odd) -> tuple[int | None, str | None]:
    """Bytes of the input tensors (the output's where an op has no input) and the first dtype."""
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not sizes and entry.get("output_sizes"):
        sizes, dtypes = entry.get("output_sizes"), entry.get("output_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list):
        return None, None
    if not sizes:
        return 0, None
    if len(sizes) > MAX_TENSORS:
        odd("input_sizes", f"{len(sizes)} tensors")
        return None, None
    total, names = 0, []
    for shape, dtype in zip(sizes, dtypes):
        name = text(dtype, odd, "dtype")
        known = schema.FR_ELEMENT_BYTES.get(name.lower()) if name is not None else None
        if known is None:
            return None, name.lower() if name is not None else None
        names.append(known[0])
        elements = _elements(shape, odd)
        if elements is None:
            return None, names[0]
        total += elements * known[1]
        if total >= _LIMIT:
            odd("input_sizes", f"{total.bit_length()}-bit byte count")
            return None, names[0]
    return total, names[0] if names else None


def _elements(shape: Any, odd: Odd) -> int | None:
    """A shape's element count: at most :data:`MAX_DIMS` non-negative dimensions, the product below
    2**63, within the dump's number budget; None (counted) otherwise."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        odd("shape", shape if not isinstance(shape, list) else f"{len(shape)} dimensions")
        return None
    odd.numbers -= len(shape)
    if odd.numbers < 0:
        odd("shape", "past the dump's budget of shape numbers")
        return None
    product = 1
    for dim in shape:
        if type(dim) is not int or not 0 <= dim < _LIMIT:
            odd("shape", dim)
            return None
        product *= dim
        if product >= _LIMIT:
            odd("shape", f"{product.bit_length()}-bit element count")
            return None
    return product
