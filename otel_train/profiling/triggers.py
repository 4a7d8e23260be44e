"""``profile_on``: the anomaly check the watchdog's thread runs at each look (docs/profiling.md).

No thread of its own and nothing on the hot path: the watchdog already drains the spans that ended
since its last look; :meth:`Triggers.look` reads the ``step`` spans and the ``comm.*`` spans among them.

* ``slow_step``: the step's duration over its running median (of the last :data:`HISTORY` judged steps).
* ``straggler`` (peer-relative, from what the comm recorder already writes): the step's *own compute*,
  its duration less the time it spent inside ``comm.*`` spans (the union of their intervals within the
  step). A rank that is slow makes its peers wait in the step's collectives: their steps grow as long
  as its, but their compute does not, so only the culprit's compute jumps. Peers therefore stay quiet
  while the culprit fires.

A step is judged once it is :data:`LAG_NS` old, because the comm recorder writes its spans up to
``POLL_S`` (0.2 s) after they ended. It fires when the value is over ``FACTOR`` x the median and over
the median by ``MIN_EXTRA_MS``, after ``WARMUP`` judged steps. Firing asks :class:`~.window.Windows` for a
window (reason ``straggler`` or ``slow_step``) and forgets the history: steps during the window are not
judged, and the ``WARMUP`` steps after it are the cooldown that learns the new normal, so a rank that
stays slow is profiled once, not again and again.

Once a second the look also takes this rank's request file, if ``watch`` (or anyone) wrote one
(:mod:`otel_train.profiling.request`): a window asked for from outside, under the same bounds.
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Any, Iterable

from otel_train import record_clock
from otel_train.profiling.request import take_request
from otel_train.profiling.window import Windows

STEP_NAME = "step"
COMM_PREFIX = "comm."
HISTORY = 32
WARMUP = 5
FACTOR = 2.0
MIN_EXTRA_MS = 100.0
LAG_NS = 300_000_000
LOOK_S = 0.1
"""The watchdog's tick while ``profile_on`` is set (it is at most 1 s otherwise)."""
MAX_KEPT = 4096
POLL_NS = 1_000_000_000
"""How often the request file ``watch`` may write (otel_train/profiling/request.py) is looked for."""


class Triggers:
    """The ``profile_on`` check: :meth:`look` with each look's ended spans (the watchdog's thread)."""

    def __init__(self, kinds: tuple[str, ...], windows: Windows) -> None:
        self.kinds = kinds
        self.windows = windows
        self.fired: list[tuple[str, float]] = []  # (reason, value ms): what asked for a window
        self._steps: deque[tuple[int, int]] = deque(maxlen=MAX_KEPT)  # (start ns, end ns), not yet judged
        self._comm: deque[tuple[int, int]] = deque(maxlen=MAX_KEPT)
        self._history: dict[str, deque[float]] = {kind: deque(maxlen=HISTORY) for kind in kinds}
        self._polled_ns = 0

    def look(self, ended: Iterable[Any], now_ns: int | None = None) -> None:
        for span in ended:
            name = span._name
            if name == STEP_NAME:
                self._steps.append((span._start_time, span._end_time))
            elif name.startswith(COMM_PREFIX):
                self._comm.append((span._start_time, span._end_time))
        now = record_clock.now_ns() if now_ns is None else now_ns
        if now - self._polled_ns >= POLL_NS:
            self._polled_ns = now
            reason = take_request(self.windows.run_dir, self.windows.rank)
            if reason is not None and self.windows.request(reason):
                self.fired.append((reason, 0.0))
        while self._steps and now - self._steps[0][1] >= LAG_NS:
            self._judge(*self._steps.popleft())
        horizon = self._steps[0][0] if self._steps else now - LAG_NS
        while self._comm and self._comm[0][1] < horizon:
            self._comm.popleft()

    def _comm_ns(self, start: int, end: int) -> int:
        """The time within ``[start, end]`` spent inside comm spans (their union)."""
        total, reach = 0, start
        for a, b in sorted(self._comm):
            a, b = max(a, reach), min(b, end)
            if b > a:
                total += b - a
                reach = b
        return total

    def _judge(self, start: int, end: int) -> None:
        windows = self.windows
        if windows.busy() or start <= windows.quiet_after_ns:
            return
        dur_ms = (end - start) / 1e6
        values = {"slow_step": dur_ms}
        if "straggler" in self.kinds:
            values["straggler"] = dur_ms - self._comm_ns(start, end) / 1e6
        for kind in self.kinds:
            value, history = values[kind], self._history[kind]
            if len(history) >= WARMUP:
                typical = median(history)
                if value > FACTOR * typical and value - typical > MIN_EXTRA_MS:
                    if windows.request(kind):
                        self.fired.append((kind, value))
                        for kept in self._history.values():
                            kept.clear()
                    return
            history.append(value)
