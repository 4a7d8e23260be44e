"""The live hang rule (docs/watch.md): a group of processes that ran together (source, attempt) is
**hung** when none of them closed a span for max(``stall_min_s``, ``stall_factor`` × the group's p99
step time so far) and one of them stalled."""

from __future__ import annotations

from collections.abc import Iterable

from otel_train.analysis.live.members import GroupKey
from otel_train.analysis.live.process import WatchedProcess
from otel_train.analysis.live.settings import StallLimits, WatchdogSettings
from otel_train.phases import STEP

Groups = dict[GroupKey, list[WatchedProcess]]


def by_group(procs: Iterable[WatchedProcess]) -> Groups:
    """Processes that ran together, by (source, attempt), ranks ascending."""
    out: Groups = {}
    for lp in sorted(procs, key=lambda p: (p.state.source, p.state.attempt, p.state.rank)):
        out.setdefault((lp.state.source, lp.state.attempt), []).append(lp)
    return out


def of_attempt(groups: Groups, attempt: int | None) -> list[WatchedProcess]:
    """The processes of every group of ``attempt``."""
    return [lp for (_, a), group in groups.items() if a == attempt for lp in group]


class HangRule:
    """Which groups are hung now (:attr:`hung`)."""

    def __init__(self) -> None:
        self.hung: set[GroupKey] = set()
        self._limits = StallLimits()  # by group

    def update(self, groups: Groups, now: float) -> bool:
        """Judge every group again; returns whether a group hung, or one that was hung moves again."""
        hung = {key for key, group in groups.items() if self._group_hung(group, now)}
        changed = hung != self.hung
        self.hung = hung
        return changed

    def _group_hung(self, group: list[WatchedProcess], now: float) -> bool:
        live = [lp for lp in group if not lp.finished]
        if not live:
            return False
        th = live[0].settings
        # Each process on its own clock (WatchedProcess.clock): the time since the group's latest progress.
        quiet = min(lp.clock(now) - (lp.progress_ts or lp.state.first_ts or lp.clock(now)) for lp in group)
        if quiet < th.stall_min_s:
            return False
        if quiet < self._run_threshold(group, th):
            return False
        return any(lp.stalled(now) for lp in live)

    def _run_threshold(self, group: list[WatchedProcess], th: WatchdogSettings) -> float:
        """max(stall_min_s, stall_factor × the group's p99 step time so far)."""
        steps = [lp.state.phases[STEP].durs for lp in group if STEP in lp.state.phases]
        return self._limits.get((group[0].state.source, group[0].state.attempt), steps, th)
