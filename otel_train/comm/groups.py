"""Process groups as the recorder sees them: the id every member shares, desc, member ranks, counters.

``comm.group`` is ``ProcessGroup.group_name``: torch gives each group the same name in every member
(it is the name Flight Recorder's ``process_group[0]`` holds). Sequence numbers:

* a collective's ``comm.seq`` is Flight Recorder's ``collective_seq_id``, read from the group's own
  counter just before the call (``_get_sequence_number_for_group() + 1``), so ops issued from C++
  (DDP's reducer) or by functional collectives never shift it. On gloo that counter also counts
  point-to-point ops, which Flight Recorder's collective sequence does not: the point-to-point ops
  this process issued in the group are subtracted. The counter value + 1 is also the entry's
  ``op_id`` on gloo (``collective_seq_id`` elsewhere): the key that matches a noted op to its Flight
  Recorder entry, so one op is one span;
* a send's ``comm.seq`` is its number among this rank's sends to that peer in the group (from 1), a
  recv's among its recvs from that peer: the k-th send A→B and the k-th recv on B from A match.
"""

from __future__ import annotations

from typing import Any

DEFAULT_DESC = "default_pg"
MESH_DESC_PREFIX = "mesh_"


class GroupState:
    """One process group; the hot path bumps its counters (single-threaded per group, like torch's)."""

    __slots__ = ("pg", "name", "desc", "ranks", "op_counts_p2p", "p2p", "sends", "recvs", "announced",
                 "last_fr_key", "gaps")

    def __init__(self, pg: Any, name: str, desc: str, ranks: list[int], op_counts_p2p: bool) -> None:
        self.pg = pg
        self.name = name
        self.desc = desc
        self.ranks = ranks
        self.op_counts_p2p = op_counts_p2p  # gloo: the group's counter is its op_id (collectives and p2p)
        self.p2p = 0  # point-to-point ops issued in this group (gloo's counter includes them)
        self.sends: dict[int, int] = {}
        self.recvs: dict[int, int] = {}
        self.announced = False  # the recorder wrote its comm.group instant
        self.last_fr_key = 0  # recorder: the highest Flight Recorder key a note of this group had
        self.gaps: list[tuple[int, int]] = []  # recorder: key ranges no note covers (ops Python did not see)

    def counter(self) -> int:
        """The group's own op counter (a plain read of a C++ integer)."""
        return int(self.pg._get_sequence_number_for_group())

    def next_collective(self) -> tuple[int, int]:
        """(``comm.seq``, Flight Recorder key) of the collective about to be issued."""
        key = self.pg._get_sequence_number_for_group() + 1
        return (key - self.p2p if self.op_counts_p2p else key), key

    def next_p2p(self, peer: int, send: bool) -> tuple[int, int | None]:
        """(``comm.seq``, Flight Recorder key or None) of the send/recv to/from ``peer`` about to be issued."""
        counts = self.sends if send else self.recvs
        seq = counts[peer] = counts.get(peer, 0) + 1
        key = None
        if self.op_counts_p2p:
            key = self.counter() + 1
            self.p2p += 1
        return seq, key

    def instant_attrs(self) -> dict[str, Any]:
        """The ``comm.group`` instant's attrs."""
        return {"group": self.name, "desc": self.desc, "ranks": list(self.ranks)}


def describe(pg: Any) -> tuple[str, str]:
    """(group id, desc) of a ProcessGroup: ``default_pg``, or a DeviceMesh dim name (``mesh_dp`` → ``dp``)."""
    name = str(pg.group_name)
    desc = str(getattr(pg, "group_desc", "") or "")
    if desc.startswith(MESH_DESC_PREFIX):
        desc = desc[len(MESH_DESC_PREFIX):]
    if not desc or desc == "undefined":
        desc = name
    return name, desc


class GroupTable:
    """ProcessGroup → :class:`GroupState`, made on first sight (on the thread that issues the op)."""

    __slots__ = ("_by_pg", "get")

    def __init__(self) -> None:
        self._by_pg: dict[Any, GroupState] = {}
        self.get = self._by_pg.get

    def add(self, pg: Any) -> GroupState:
        from torch.distributed import distributed_c10d as c10d

        name, desc = describe(pg)
        ranks = [int(r) for r in c10d.get_process_group_ranks(pg)]
        backend = str(pg._get_backend_name()) if hasattr(pg, "_get_backend_name") else ""
        state = GroupState(pg, name, desc, ranks, op_counts_p2p=backend != "nccl")
        return self._by_pg.setdefault(pg, state)  # atomic: the hot path and the recorder may both add it

    def states(self) -> list[GroupState]:
        return list(self._by_pg.values())

    def forget(self, pg: Any = None) -> None:
        """Drop ``pg`` (None: every group), which ``destroy_process_group`` destroyed: the table must not
        keep a destroyed group (its threads, sockets, communicators) alive for the rest of the process."""
        if pg is None:
            self._by_pg.clear()
        else:
            self._by_pg.pop(pg, None)

    def by_name(self, name: str) -> GroupState | None:
        for state in list(self._by_pg.values()):
            if state.name == name:
                return state
        return None
