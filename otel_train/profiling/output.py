"""Where a window's trace goes, and the ``profile`` instant that names it (docs/profiling.md).

``<run>/profiles/rank_<r>/<reason>.steps_<first>-<last>[.attempt_<a>].pt.trace.json``: Kineto's JSON,
as ``torch.profiler``'s ``export_chrome_trace`` writes it, written next to its name and renamed into
place (a reader never sees half a file). The ``profile`` instant's ``path`` is relative to the run
directory; ``marker_us`` brackets, on the records' clock, the marker event (:data:`MARKER`) the window
recorded as it opened, which is how the export aligns Kineto's timestamps to the span records.
"""

from __future__ import annotations

import os
from typing import Any

from otel_train.schema import INSTANT_PROFILE, PROFILE_MARKER as MARKER, PROFILES_DIR  # noqa: F401 - shared names


def window_name(reason: str, first: int, last: int, attempt: int | None) -> str:
    suffix = f".attempt_{attempt}" if attempt else ""
    return f"{reason}.steps_{first}-{last}{suffix}.pt.trace.json"


def relative_path(rank: int, name: str) -> str:
    """The trace file's path relative to the run directory (what the instant's ``path`` holds)."""
    return f"{PROFILES_DIR}/rank_{rank}/{name}"


def write_trace(profiler: Any, run_dir: str, rel: str) -> None:
    """Export ``profiler``'s trace to ``run_dir/rel`` through a temporary name."""
    path = os.path.join(run_dir, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        profiler.export_chrome_trace(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def instant_attrs(first: int, last: int, reason: str, rel: str, marker_ns: tuple[int, int], window: int,
                  activities: list[str]) -> dict[str, Any]:
    return {"steps": [first, last], "reason": reason, "path": rel, "window": window,
            "marker_us": [marker_ns[0] / 1e3, marker_ns[1] / 1e3], "activities": activities}
