"""The run as ``watch`` follows it (:class:`LiveRun`): each poll reads what is new and returns events.

One poll, in order: read (the tail) → the processes followed (:mod:`.members`) take their records →
the hosts' lags (:mod:`.skew`) → the comm graphs, the Flight Recorder dumps and the clock
(:mod:`.graphs`, :mod:`.dumps`) → liveness (:meth:`WatchedProcess.look`) → the hang rule
(:mod:`.hangs`) → findings, asked of the live snapshot when something changed, and raised once
(:mod:`.raised`) → the straggler rule on its own schedule (:mod:`.stragglers`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_train.analysis.comm import CommGraph
from otel_train.analysis.findings import findings
from otel_train.analysis.live.dumps import DumpPoller, ReadDumps
from otel_train.analysis.live.graphs import LiveClock, LiveGraphs
from otel_train.analysis.live.hangs import Groups, HangRule, by_group
from otel_train.analysis.live.host import HostProbe
from otel_train.analysis.live.members import GroupKey, ProcessKey, RunMembers
from otel_train.analysis.live.process import WatchedProcess
from otel_train.analysis.live.raised import Event, RaisedFindings
from otel_train.analysis.live.skew import HostLag
from otel_train.analysis.live.stragglers import StragglerAsks
from otel_train.analysis.records import BadLines, ProcessFiles, Tail, Warn
from otel_train.analysis.spans import ProcessState, Run

RESTART_GRACE_S = 60.0
"""After every process ended with a failure, how long to wait for the launcher's next attempt when it
said one may come (torchrun's ``TORCHELASTIC_MAX_RESTARTS`` above ``TORCHELASTIC_RESTART_COUNT``)."""


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
                 read_fr: ReadDumps | None = None, align: bool = True) -> None:
        self.tail = Tail(Path(path), BadLines(warn))
        self.probe = probe if probe is not None else HostProbe()
        self.clock = clock
        # Watch's own monotonic time, for how long since it read a process (an injected clock is its own).
        self._elapsed: Callable[[float], float] = (lambda now: time.monotonic()) if clock is time.time else (lambda now: now)
        self.procs: dict[ProcessKey, WatchedProcess] = {}
        self._members = RunMembers(self.tail.path, self.tail.bad.warn)
        self._lag = HostLag(align and clock is time.time)  # file times are on the real clock, not a test's
        self._graphs = LiveGraphs()
        self._dumps = DumpPoller(fr, read_fr)
        self._clock = LiveClock(align)
        self._hangs = HangRule()
        self._found = RaisedFindings(self.procs, self.probe, stacks)
        self._stragglers = StragglerAsks(background)
        self._dirty = False  # findings are to be asked of the next snapshot

    @property
    def graphs(self) -> dict[GroupKey, CommGraph]:
        """The comm graph of each (source, attempt)."""
        return self._graphs.graphs

    @property
    def raised(self) -> list[dict[str, Any]]:
        """Every finding raised, in order."""
        return self._found.raised

    @property
    def align(self) -> bool:
        """Whether hosts are compared on the estimated reference clock (False: raw clocks)."""
        return self._clock.align

    @property
    def stacks(self) -> bool:
        """Whether hang and crash findings carry the culprit's stacks."""
        return self._found.stacks

    @property
    def background(self) -> bool:
        """Whether the straggler rule is asked in a worker thread."""
        return self._stragglers.background

    @property
    def malformed_lines(self) -> int:
        """Lines skipped so far."""
        return self.tail.malformed_lines

    def _states(self) -> list[ProcessState]:
        return [lp.state for lp in self.procs.values()]

    # -- reading -------------------------------------------------------------------------------

    def poll(self) -> list[Event]:
        """Read what was written since the last poll, update liveness, and return new events."""
        now = self.clock()
        batches = self.tail.poll()
        new = [pf for pf, _ in batches if not self._members.known(pf.key)]
        if new:
            self._add(new)
        batches = [(pf, records) for pf, records in batches if pf.key in self.procs]  # not another run's
        for pf, records in batches:
            self._dirty |= self.procs[pf.key].take(records, self.tail.bad.warn)
        self._lag.update(batches, self.procs)
        for pf, records in batches:
            if records:
                self.procs[pf.key].mark_read(now, raw=not self.align)
        self._dirty |= self._update_comm({pf.key for pf, _ in batches}, now)
        self._clock.update(self.graphs, self._states, now)
        for lp in self.procs.values():
            self._dirty |= lp.look(self.probe, now)
        return self._evaluate(now)

    def _add(self, pfs: list[ProcessFiles]) -> None:
        """Start following the processes of the run watched that appeared."""
        new, attempts = self._members.admit(pfs)
        if not new:
            return
        for key, lp in self.procs.items():  # unnumbered restarts are renumbered by start time
            if lp.state.attempt != attempts[key]:
                self._graphs.reset()  # the comm graphs are by attempt: made again
            lp.state.attempt = attempts[key]
        for pf in new:
            state = ProcessState.of(pf, attempts[pf.key], meta=self._members.head(pf.key))
            self.procs[pf.key] = WatchedProcess(state, self.probe.is_local(state.host, state.pid), self._elapsed)
        self._dirty = True

    def _update_comm(self, keys: set[ProcessKey], now: float) -> bool:
        """Add what the processes that wrote (``keys``) closed or wait in to their comm graphs, and
        dumps that changed; returns whether a desync appeared or dumps brought ops (findings must be asked)."""
        desyncs = self._graphs.desyncs()
        self._graphs.feed({key: self.procs[key].state for key in keys})
        self._graphs.prune(self._states)
        dumps = self._dumps.poll(now)
        if dumps is not None:
            self._graphs.add_dumps(*dumps)
        return (dumps is not None and bool(dumps[0])) or self._graphs.desyncs() != desyncs

    # -- deciding ------------------------------------------------------------------------------

    def groups(self) -> Groups:
        """Processes that ran together, by (source, attempt), ranks ascending."""
        return by_group(self.procs.values())

    def _evaluate(self, now: float) -> list[Event]:
        groups = self.groups()
        self._dirty |= self._hangs.update(groups, now)  # a group hung, or one that was hung moves again
        hung = self._hangs.hung
        running = {lp.state for key, group in groups.items() if key not in hung for lp in group if not lp.finished}
        events = self._found.resolve_hangs(groups, hung, now)
        if self._dirty:
            self._dirty = False
            alive = {lp.state for lp in self.procs.values() if not lp.dead}
            run = Run(self._states())
            if self._graphs.empty and self.procs:  # graphs dropped (attempts renumbered): made again
                self._update_comm(set(self.procs), now)
            found = findings(run, alive=alive, running=running, stragglers=False, graphs=self.graphs)
            events += self._found.add(found, groups, running, now)
        if not self._stragglers.busy:
            due = self._stragglers.due(groups, now)
            if due:
                order = Run(self._states()).phase_order()
                self._stragglers.ask(groups, due, self.graphs, order)
        events += self._straggler_results(groups, running, now)
        if self._found.ask_again:  # a finding held back: asked again at the next poll
            self._found.ask_again, self._dirty = False, True
        return events

    def _straggler_results(self, groups: Groups, running: set[ProcessState], now: float) -> list[Event]:
        """Stragglers of a finished ask raised; those it no longer names resolved."""
        answer = self._stragglers.result(now)
        if answer is None:
            return []
        found, due = answer
        events = self._found.add(found, groups, running, now)
        return events + self._found.resolve_stragglers(found, {attempt for _, attempt in due}, now)

    def close(self) -> None:
        """Stop a straggler ask still running (its result is not wanted any more)."""
        self._stragglers.close()

    # -- the end -------------------------------------------------------------------------------

    def finished(self, now: float | None = None) -> bool:
        """Every process ended or died, and no new attempt is expected: at once, unless the latest
        attempt failed and its launcher may restart it (then up to :data:`RESTART_GRACE_S`)."""
        if not self.procs or self._stragglers.busy or any(not lp.finished for lp in self.procs.values()):
            return False  # (a straggler ask still running has the last word on the stragglers)
        now = self.clock() if now is None else now
        latest = max(lp.state.attempt for lp in self.procs.values())
        last = [lp for lp in self.procs.values() if lp.state.attempt == latest]
        if not any(lp.restarts_left for lp in last):
            return True
        clean = all(lp.state.ended_cleanly for lp in last) and not self._found.failed(latest)
        return clean or now - max(lp.gone_at or now for lp in last) >= RESTART_GRACE_S

    def rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """One row per process for a live table: rank, attempt, step, open spans, open for, state.

        While a hang (or desync) is active, its culprit's state is ``culprit`` (``culprit (silent)``,
        ``culprit (dead)``) and each victim's ``waiting on <culprit>``, whatever their own state (every
        rank of a hung run is stalled)."""
        now = self.clock() if now is None else now
        blame = self._found.blame()
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
