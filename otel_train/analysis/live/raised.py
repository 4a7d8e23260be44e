"""The findings ``watch`` raised (docs/watch.md): each raised once, some held back until they are sure,
hangs and stragglers kept active until they are resolved.

A hang is *resolved* when its culprit closes a span again and its group is no longer hung; a straggler
when the rule no longer names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from otel_train.analysis.findings import CRASH, DESYNC, ERROR, HANG, RESTART, STRAGGLER, is_collective_failure
from otel_train.analysis.live.dumps import FR_POLL_S
from otel_train.analysis.live.hangs import Groups, of_attempt
from otel_train.analysis.live.host import HostProbe
from otel_train.analysis.live.members import GroupKey, ProcessKey
from otel_train.analysis.live.process import WatchedProcess
from otel_train.analysis.spans import ProcessState

UNNAMED_HOLD_S = FR_POLL_S + 1.0
"""A hang that names no rank (every waiter's op issued by every member, or ranks that wait for each
other) is raised only once it has been the answer this long, while a process of its attempt still
lives: the views it comes from (each rank's file, each rank's dump, read at different moments) may
still be catching up with a culprit. A run whose processes all ended or died gets it at once."""

Event = dict[str, Any]
Finding = dict[str, Any]


class RaisedFindings:
    """Every finding raised, in order (:attr:`raised`), and the active hangs and stragglers.

    ``stacks``: hang and crash findings carry the culprit's stacks (its latest stall record, or a
    py-spy dump by ``probe`` of a silent process on this host). :attr:`ask_again` is set when a
    finding was held back: findings are to be asked again at the next poll.
    """

    def __init__(self, procs: Mapping[ProcessKey, WatchedProcess], probe: HostProbe, stacks: bool) -> None:
        self._procs = procs
        self._probe = probe
        self.stacks = stacks
        self.raised: list[Finding] = []
        self.ask_again = False
        self._keys: set[tuple[Any, ...]] = set()
        self._unnamed: dict[Any, float] = {}  # attempt -> when a hang naming no rank was first the answer
        self._active: dict[tuple[Any, ...], tuple[float, Finding]] = {}  # hangs and stragglers

    def add(self, found: list[Finding], groups: Groups, running: set[ProcessState], now: float) -> list[Event]:
        """Raise what is new in ``found`` and not premature; returns their events."""
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

    def _premature(self, f: Finding, groups: Groups, running: set[ProcessState], now: float) -> bool:
        """Findings that must wait: a collective failure while its group still runs (its culprit is
        usually another rank, not yet known); a crash that is the echo of a hang already raised; a hang
        that names no rank, for :data:`UNNAMED_HOLD_S`; with
        ``stacks``, a hang whose culprit's watchdog is about to write its stall record (the stacks)."""
        if f["kind"] == ERROR and is_collective_failure("", f["message"]):
            return any(lp.state in running for lp in of_attempt(groups, f["attempt"]))
        if f["kind"] == CRASH:
            return (HANG, f["attempt"], f["rank"], None) in self._keys
        if f["kind"] == HANG and f.get("rank") is None and any(not lp.finished for lp in of_attempt(groups, f["attempt"])):
            since = self._unnamed.setdefault(f["attempt"], now)
            if now - since < UNNAMED_HOLD_S:
                self.ask_again = True  # at the next poll: a culprit may be named by then
                return True
        if f["kind"] == HANG and self.stacks and "stacks" not in f:
            culprit = self._culprit(f)
            if culprit is not None and culprit.awaiting_stall_record(now):
                self.ask_again = True
                return True
        return False

    def _complete(self, f: Finding, now: float) -> Finding:
        """The finding as watch prints it: victims always, ``since`` for a stop, stacks only when asked."""
        f = {**f, "victims": f.get("victims", [])}
        stacks = f.pop("stacks", None)
        lp = self._culprit(f)
        if f["kind"] in (HANG, CRASH) and lp is not None:
            inner = lp.state.innermost
            f["since"] = inner.start_ts if inner is not None and not lp.state.ended_cleanly else lp.state.last_ts
            if self.stacks and stacks is None and lp.local and lp.silent and not lp.dead:
                stacks = self._probe.dump(lp.state.pid, inner.tid if inner is not None else None)  # type: ignore[arg-type]
        if self.stacks and stacks:
            f["stacks"] = stacks
        return f

    def _culprit(self, f: Finding) -> WatchedProcess | None:
        matches = [lp for lp in self._procs.values() if lp.state.rank == f["rank"] and lp.state.attempt == f["attempt"]]
        return matches[0] if len(matches) == 1 else None

    def resolve_hangs(self, groups: Groups, hung: set[GroupKey], now: float) -> list[Event]:
        """Hangs whose group is no longer hung and whose culprit (any rank, for a group-wide one) closed
        a span since it stopped."""
        events = []
        for key, (raised_at, f) in list(self._active.items()):
            if f["kind"] != HANG or any(attempt == f["attempt"] for _, attempt in hung):
                continue
            movers = [lp for lp in of_attempt(groups, f["attempt"]) if f["rank"] is None or lp.state.rank == f["rank"]]
            if any((lp.progress_ts or 0.0) > (f.get("since") or raised_at) and not lp.finished for lp in movers):
                events.append(self._resolved(key, now))
        return events

    def resolve_stragglers(self, found: Iterable[Finding], judged: set[int], now: float) -> list[Event]:
        """Stragglers of the ``judged`` attempts that the rule's answer ``found`` no longer names."""
        current = {_key(f) for f in found}
        return [self._resolved(key, now) for key, (_, f) in list(self._active.items())
                if f["kind"] == STRAGGLER and f["attempt"] in judged and key not in current]

    def _resolved(self, key: tuple[Any, ...], now: float) -> Event:
        _, f = self._active.pop(key)
        self._keys.discard(key)  # it may be raised again
        return {"type": "resolved", "ts": now, "finding": f}

    def failed(self, attempt: int) -> bool:
        """Whether a hang, crash or error was raised for ``attempt``."""
        return any(f["kind"] in (HANG, CRASH, ERROR) and f["attempt"] == attempt for f in self.raised)

    def blame(self) -> dict[tuple[int, int], str]:
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


def _key(f: Finding) -> tuple[Any, ...]:
    kind = f["kind"]
    if kind == RESTART:
        return (kind, f["attempt"], f.get("progress"))
    if kind in (ERROR, STRAGGLER):
        return (kind, f["attempt"], f["rank"], f["phase"], f["step"] if kind == ERROR else None)
    return (kind, f["attempt"], f["rank"], None)
