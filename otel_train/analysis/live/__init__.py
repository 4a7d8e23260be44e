"""Live diagnosis: follow a run while it is written and name the culprit as it happens (``otel-train watch``).

One state and one set of rules with summarize: every process's files are followed by a
:class:`~otel_train.analysis.records.Tail` and fed into the same
:class:`~otel_train.analysis.spans.ProcessState` summarize builds, and the findings are those of
:func:`~otel_train.analysis.findings.findings`, asked of the live snapshot. What is live-only is the
knowledge of which processes still run, and *when* to ask (docs/watch.md):

* a process has **ended** when it wrote ``process_end``; it is **dead** when its pid is gone on this
  host or, elsewhere, when it wrote nothing, not even a heartbeat, for 3 × ``heartbeat_s``; a process
  on this host that is alive but wrote nothing for that long is **silent** (a thread holds the GIL);
* it is **stalled** when its innermost open span has been open past that name's stall threshold in
  that process (``otel_train.stall``, the watchdog's rule), or the watchdog wrote a ``stall`` for it;
* a group of processes that ran together (source, attempt) is **hung** when none of them closed a
  span for max(``stall_min_s``, ``stall_factor`` × the group's p99 step time so far) and one of them
  stalled. Processes of a hung group, dead ones and ended ones are the snapshot's stopped processes;
  the others are still *running* and no hang or crash is looked for in them;
* findings are asked for when a process appears, ends or dies, an error span appears, or a group
  hangs or moves again; the straggler rule every :data:`~.stragglers.STRAGGLERS_EVERY_S` over each running group's
  last :data:`~.stragglers.RECENT_STEPS` steps, and once when the group has finished. Each finding is raised once.
  A hang is *resolved* when its culprit closes a span again and its group is no longer hung; a
  straggler when the rule no longer names it;
* the comm graph (docs/comm.md) is kept live too: each poll adds the ops each process closed or
  waits in, so a ``desync`` is raised at the poll that reads the second side of its seq, and a hang
  names the op with the same rules as summarize. Flight Recorder dumps (``fr``) are read again when
  the directory changes (looked at every :data:`~.dumps.FR_POLL_S`).

Thresholds come from each process's own settings (its ``process_start`` record), defaults otherwise.

The modules, one job each: :mod:`.live_run` (:class:`LiveRun`, one poll in order), :mod:`.members`
(which processes are followed), :mod:`.process` (one followed process), :mod:`.own_time` (its own
time and clock), :mod:`.settings` (its watchdog settings, stall thresholds), :mod:`.host` (probing
this host's processes), :mod:`.skew` (hosts' lags from file times), :mod:`.graphs` (live comm graphs
and their clock), :mod:`.dumps` (Flight Recorder polling), :mod:`.hangs` (the hang rule),
:mod:`.stragglers` (the straggler rule's schedule), :mod:`.raised` (findings raised once, held back,
resolved).
"""

from otel_train.analysis.live.host import HostProbe
from otel_train.analysis.live.live_run import LiveRun
from otel_train.analysis.live.process import WatchedProcess
from otel_train.analysis.live.raised import UNNAMED_HOLD_S
from otel_train.analysis.live.settings import WatchdogSettings

__all__ = ["UNNAMED_HOLD_S", "HostProbe", "LiveRun", "WatchdogSettings", "WatchedProcess"]
