"""What a watched process's own settings say (its ``process_start`` record), and the stall thresholds
worked out from them (docs/watch.md)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from otel_train.config import Settings
from otel_train.stall import stall_threshold

DEAD_AFTER_HEARTBEATS = 3
"""A process that wrote nothing for this many heartbeat periods is dead (or, on this host and alive, silent)."""


@dataclass(frozen=True, slots=True)
class WatchdogSettings:
    """A process's watchdog settings (from its ``process_start`` record), which the live rules use too."""

    watchdog: bool
    heartbeat_s: float
    stall_min_s: float
    stall_factor: float

    @classmethod
    def of(cls, settings: Mapping[str, Any] | None) -> WatchdogSettings:
        """From a ``process_start`` record's ``settings``; defaults for what is missing or malformed."""
        base = Settings()
        given = settings if isinstance(settings, Mapping) else {}

        def seconds(key: str, low: float) -> float:
            value = given.get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < float("inf")
            return float(value) if ok else float(getattr(base, key))

        watchdog = given.get("watchdog")
        return cls(watchdog if isinstance(watchdog, bool) else base.watchdog, seconds("heartbeat_s", 0.0),
                   seconds("stall_min_s", 1e-3), seconds("stall_factor", 1.0))

    @property
    def silence_s(self) -> float:
        """No record for this long: dead (elsewhere) or silent (on this host)."""
        return DEAD_AFTER_HEARTBEATS * (self.heartbeat_s or Settings().heartbeat_s)


DEFAULT_WATCHDOG_SETTINGS = WatchdogSettings.of(None)


def restarts_left(env: Any) -> int:
    """Restarts torchrun may still make after this attempt, from the recorded environment."""
    if not isinstance(env, Mapping):
        return 0
    try:
        return max(0, int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    except (TypeError, ValueError):
        return 0


def p99_s(durs_ms: Iterable[float]) -> tuple[int, float | None]:
    """How many durations (ms) there are, and their p99 in seconds (None without any)."""
    values = np.asarray(durs_ms, dtype=float)
    if not values.size:
        return 0, None
    return int(values.size), float(np.quantile(values, 0.99)) / 1000.0


class StallLimits:
    """Stall thresholds (max(``stall_min_s``, ``stall_factor`` × p99), :func:`otel_train.stall.stall_threshold`)
    by key, worked out again only when the key has new durations: they are asked every poll."""

    __slots__ = ("_cached",)

    def __init__(self) -> None:
        self._cached: dict[Hashable, tuple[int, float]] = {}  # key -> (durations seen, threshold)

    def get(self, key: Hashable, durs_ms: Sequence[Sequence[float]], settings: WatchdogSettings) -> float:
        """The threshold over the durations of ``durs_ms`` (one sequence or several), in seconds."""
        seen = sum(len(d) for d in durs_ms)
        cached = self._cached.get(key)
        if cached is None or cached[0] != seen:
            count, p99 = p99_s(np.concatenate(durs_ms) if durs_ms else ())
            cached = self._cached[key] = (seen, stall_threshold(count, p99, settings.stall_min_s,
                                                                settings.stall_factor))
        return cached[1]
