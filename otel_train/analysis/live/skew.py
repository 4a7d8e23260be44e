"""Hosts whose clocks are off, as the files they write say (docs/clock.md): a host whose records reach
their files later (or earlier) than the files' modification times say is on a clock of its own."""

from __future__ import annotations

from collections.abc import Mapping

from otel_train.analysis.live.members import ProcessKey
from otel_train.analysis.live.process import WatchedProcess
from otel_train.analysis.records import AnyRecord, ProcessFiles

SKEW_APPLY_S = 0.5
"""A host whose records reach their files this much later (or earlier) than the files' modification
times say is on a clock of its own: its times are compared with watch's own clock shifted by that."""


class HostLag:
    """Each host's lag: the least, over reads of a file seen growing since the previous read (written
    live: a copied or finished file says nothing of its writer's clock), of its modification time (the
    file system's clock, not the writer's) minus the newest record read from it. A host off by more
    than :data:`SKEW_APPLY_S` gets that as its processes' ``skew`` (stalls, silence and progress are
    then judged on its own clock; durations within a process need none). ``enabled`` only on the real
    clock (an injected clock is a test's: file times do not follow it)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lag: dict[str | None, float] = {}  # host -> least (file mtime - newest record ts) seen
        self._sizes: dict[ProcessKey, int] = {}  # each process's newest file size at the last read

    def update(self, batches: list[tuple[ProcessFiles, list[AnyRecord]]],
               procs: Mapping[ProcessKey, WatchedProcess]) -> None:
        """After a read: each host's lag from the files that grew, and each process's skew when it moved."""
        changed = set()
        for pf, records in batches if self.enabled else ():
            if not records or not pf.paths:
                continue
            try:
                st = pf.paths[-1].stat()
            except OSError:
                continue
            before, self._sizes[pf.key] = self._sizes.get(pf.key), st.st_size
            if before is None or st.st_size <= before:
                continue
            lp = procs[pf.key]
            host, newest = lp.state.host, lp.own.latest  # not a record from the future (own_time.py)
            lag = st.st_mtime - (newest if newest is not None else max(r.ts for r in records))
            if lag < self._lag.get(host, float("inf")):
                self._lag[host] = lag
                changed.add(host)
        if changed:
            for lp in procs.values():
                lag = self._lag.get(lp.state.host, 0.0)
                lp.skew = lag if abs(lag) >= SKEW_APPLY_S else 0.0
