"""A command's result served again while its run is unchanged (docs/analysis.md, "Reading").

:func:`remembered` wraps what a command computes from a run: when the run's cache holds a result of
the same command, arguments and code for inputs that are the same now
(:class:`otel_train.analysis.reading.cache.Recall`), that result is printed again with the warnings
it said, and nothing is read; else the result is computed, its warnings recorded, and kept. A bad
``OTEL_TRAIN_CACHE_MB`` is one line and exit 2, unless the cache is off (``--no-cache``). Only the
reading cache module is imported before that: a served result costs the start-up and the identities.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from otel_train.cli import _common

T = TypeVar("T")


def remembered(command: str, paths: Sequence[Path], args: Mapping[str, Any], compute: Callable[[], T], *,
               enabled: bool = True) -> T:
    """``compute()``, or the result it gave for the same ``command``, ``args`` and runs at ``paths``
    while their inputs are unchanged; ``enabled`` False (``--no-cache``): always computed, never kept."""
    from otel_train.analysis.reading.cache import CacheSettingError, Recall, max_bytes
    from otel_train.analysis.reading.discovery import TraceReadError, logs_dir

    if enabled:
        try:
            max_bytes()  # a bad OTEL_TRAIN_CACHE_MB: one line, exit 2 (ignored with --no-cache)
        except CacheSettingError as exc:
            _common.fail(str(exc), 2)
    try:
        logs = [logs_dir(p) for p in paths]
    except TraceReadError:
        return compute()  # the command says what is wrong with the path
    recall = Recall(command, logs, args, enabled=enabled)
    hit = recall.recall() if enabled else None
    if hit is not None:
        value, said = hit
        for line in said:
            _common.warn(line)
        return value  # type: ignore[no-any-return]
    heard: list[str] = []
    _common.HEARD.append(heard)
    try:
        with recall.recording():
            value = compute()
    finally:
        _common.HEARD.remove(heard)
    if enabled:
        recall.keep(value, heard)
    return value
