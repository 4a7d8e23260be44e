"""The profiling settings' converters and the scheduled windows (docs/profiling.md).

Pure: knows nothing of torch, OTel or files. The converters follow :mod:`otel_train.config`'s
convention: ``(value, from_env) -> typed value``, raising ValueError/TypeError for a bad value (the
resolver turns that into a one-line ConfigError with the field's ``expect`` text).
"""

from __future__ import annotations

import re
from typing import Any

PROFILE_ON = ("straggler", "slow_step")
ACTIVITIES = ("cpu", "cuda", "shapes", "stack", "memory")
MEMORY_SNAPSHOT = ("off", "on_oom")
MAX_STEP = 2**53
MAX_WINDOW = 10_000
"""Steps in one window at most: a profiler window is for a few steps, never a run."""

_RANGE = re.compile(r"(\d+)\s*-\s*(\d+)")
_EVERY = re.compile(r"every\s*=\s*(\d+)\s*:\s*(\d+)")


def _parts(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return [part.strip() if isinstance(part, str) else part for part in value]
    raise TypeError(value)


def profile_ranks(value: Any, from_env: bool) -> tuple[int, ...] | str:
    """``all``, or global ranks (``0,5`` or a list of ints): the ranks that run scheduled windows."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return "all"
    ranks = []
    for part in _parts(value):
        if isinstance(part, str) and part.isdigit():
            part = int(part)
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part <= MAX_STEP:
            raise ValueError(value)
        ranks.append(part)
    if not ranks:
        raise ValueError(value)
    return tuple(sorted(set(ranks)))


def profile_steps(value: Any, from_env: bool) -> str:
    """``A-B`` (inclusive, A <= B, at most MAX_WINDOW steps) or ``every=N:K`` (1 <= K <= N): normalised."""
    if not isinstance(value, str):
        raise TypeError(value)
    text = value.strip().lower()
    match = _RANGE.fullmatch(text)
    if match:
        first, last = int(match[1]), int(match[2])
        if first > last or last > MAX_STEP or last - first >= MAX_WINDOW:
            raise ValueError(value)
        return f"{first}-{last}"
    match = _EVERY.fullmatch(text)
    if match:
        every, steps = int(match[1]), int(match[2])
        if not 1 <= steps <= min(every, MAX_WINDOW) or every > MAX_STEP:
            raise ValueError(value)
        return f"every={every}:{steps}"
    raise ValueError(value)


def _names(choices: tuple[str, ...], value: Any) -> tuple[str, ...]:
    names = _parts(value)
    if not all(isinstance(name, str) and name.lower() in choices for name in names):
        raise ValueError(value)
    return tuple(dict.fromkeys(name.lower() for name in names))


def profile_on(value: Any, from_env: bool) -> tuple[str, ...]:
    """``straggler``, ``slow_step``, both (comma-separated), or empty (none)."""
    return _names(PROFILE_ON, value)


def profile_activities(value: Any, from_env: bool) -> tuple[str, ...]:
    """``cpu``, ``cuda`` (where a GPU exists), ``shapes``, ``stack``, ``memory``: at least one activity."""
    names = _names(ACTIVITIES, value)
    if "cpu" not in names and "cuda" not in names:
        raise ValueError(value)
    return names


class Schedule:
    """Which steps the scheduled windows of ``profile_steps`` cover.

    ``A-B``: one window, steps A..B (a process that starts inside it, e.g. resumed at a later step,
    profiles from its first step there to B). ``every=N:K``: a window of K steps from each multiple of N
    (N, 2N, ...; never step 0, which is warm-up): steps N..N+K-1, 2N..2N+K-1, ...
    """

    __slots__ = ("first", "last", "every", "steps")

    def __init__(self, spec: str) -> None:
        self.first = self.last = self.every = self.steps = 0
        if spec.startswith("every="):
            every, _, steps = spec[len("every="):].partition(":")
            self.every, self.steps = int(every), int(steps)
        else:
            first, _, last = spec.partition("-")
            self.first, self.last = int(first), int(last)

    def window_at(self, step: int) -> tuple[int, int] | None:
        """The scheduled window ``(first, last)`` that ``step`` falls in, or None."""
        if self.every:
            if step < self.every:
                return None
            start = step - step % self.every
            return (start, start + self.steps - 1) if step - start < self.steps else None
        return (self.first, self.last) if self.first <= step <= self.last else None

    def next_start(self, step: int) -> int:
        """The least step >= ``step`` in a scheduled window (MAX_STEP + 1 when there is none)."""
        if self.window_at(step) is not None:
            return step
        if self.every:
            return max(self.every, step - step % self.every + self.every)
        return self.first if step < self.first else MAX_STEP + 1
