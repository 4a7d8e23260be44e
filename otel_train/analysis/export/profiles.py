"""``export --profiles``: torch.profiler windows merged into a Chrome trace export (docs/profiling.md).

Each ``profile`` instant in the export names a window's Kineto trace (``path``, relative to the run
directory; a path that leaves ``<run>/profiles/`` is refused). Its ``X`` events (operators, kernels,
runtime calls, annotations) are added to the rank's process, on tracks of their own (one per Kineto
thread or stream, named ``profiler: …``, sorted after the span tracks), at the trace's clock:

* Kineto's times are wall-clock µs: ``baseTimeNanoseconds / 1000 + ts``.
* The window recorded a marker (``otel_train.profile_marker``) as it opened, and the instant's
  ``marker_us`` brackets that moment on the records' clock; the marker's Kineto midpoint is put on the
  bracket's midpoint. The error is at most half the bracket less the marker's duration (``align``).
* Then the move the export applied to the rank's host, if any (the instant's ``raw_ts``), and the
  trace's origin (``otherData.trace_start_unix_us``).

Chrome format only: the file is read back whole, events appended, and written next to it and renamed
into place; merging twice adds nothing (``otherData.profiles`` says what was merged).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_train.analysis.export.layout import TID_STRIDE
from otel_train.schema import INSTANT_PROFILE as INSTANT, PROFILE_MARKER as MARKER, PROFILES_DIR
from otel_train.analysis.records import logs_dir

RAW_TS = "raw_ts"  # the export's name for a moved record's own time (docs/clock.md)
SORT_BASE = 1_000_000
"""Profiler tracks sort after every span track of the process."""


@dataclass
class Merged:
    """What a merge added: windows merged, events added, and one line per window that could not be."""

    windows: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0
    problems: list[str] = field(default_factory=list)


def run_dir(path: str | Path) -> Path:
    logs = logs_dir(path)
    return logs.parent if logs.name == "structured_logs" else logs


def merge(output: str | Path, path: str | Path) -> Merged:
    """Add the profiler windows of the run at ``path`` to the Chrome trace ``output`` (see the module doc)."""
    output = Path(output)
    doc = json.loads(output.read_bytes())
    other = doc.setdefault("otherData", {})
    result = Merged()
    if "profiles" in other:
        result.windows = other["profiles"]
        return result
    events: list[dict[str, Any]] = doc["traceEvents"]
    origin = other.get("trace_start_unix_us", 0)
    tracks: dict[tuple[int, str], int] = {}
    processes = {e.get("pid"): (e.get("args") or {}).get("name") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    added: list[dict[str, Any]] = []
    for event in [e for e in events if e.get("ph") == "i" and e.get("name") == INSTANT]:
        try:
            window, moved = _window(event, run_dir(path), origin, tracks)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            result.problems.append(f"{_where(event)}: {exc}")
            continue
        result.windows.append({"process": processes.get(window["pid"]), **window})
        added.extend(moved)
    added.extend(_track_names(tracks))
    result.events = sum(1 for e in added if e.get("ph") == "X")
    events.extend(added)
    other["profiles"] = result.windows
    _write(output, doc)
    return result


def _where(event: dict[str, Any]) -> str:
    args = event.get("args") or {}
    return f"window {str(args.get('path'))!r} (pid {event.get('pid')})"


def _window(event: dict[str, Any], run: Path, origin: float, tracks: dict[tuple[int, str], int]
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    args = event["args"]
    kineto = _read_kineto(run, args["path"])
    base_us = int(kineto.get("baseTimeNanoseconds", 0)) / 1e3
    marker = next((e for e in kineto.get("traceEvents", []) if e.get("name") == MARKER and e.get("ph") == "X"), None)
    lo, hi = (float(v) for v in args["marker_us"])
    if marker is None:
        raise ValueError(f"no {MARKER} event in the profiler trace (not written by otel-train?)")
    k_mid = base_us + float(marker["ts"]) + float(marker.get("dur", 0)) / 2
    to_records = (lo + hi) / 2 - k_mid  # Kineto wall µs -> records' µs
    error_us = max(0.0, (hi - lo) - float(marker.get("dur", 0))) / 2
    shift = (event["ts"] + origin - float(args[RAW_TS]) * 1e6) if RAW_TS in args else 0.0
    offset = base_us + to_records + shift - origin
    pid = event["pid"]
    names = _thread_names(kineto)
    moved = []
    for e in kineto.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("name") == MARKER or "ts" not in e:
            continue
        key = (pid, names.get((e.get("pid"), e.get("tid")), f"thread {e.get('tid')}"))
        tid = tracks.setdefault(key, pid * TID_STRIDE + TID_STRIDE - 1 - len(tracks))
        moved.append({"ph": "X", "name": str(e.get("name", "")), "cat": f"profiler.{e.get('cat', 'op')}",
                      "ts": round(float(e["ts"]) + offset, 3), "dur": round(float(e.get("dur", 0)), 3),
                      "pid": pid, "tid": tid, "args": {**(e.get("args") or {}), "window": args["path"]}})
    window = {"pid": pid, "steps": args.get("steps"), "reason": args.get("reason"), "path": args["path"],
              "events": len(moved), "align_us": round(to_records, 3), "align_error_us": round(error_us, 3)}
    return window, moved


def _read_kineto(run: Path, rel: str) -> dict[str, Any]:
    """The Kineto JSON at ``run/rel``; a path outside ``run/profiles/`` is refused (trace text is data)."""
    root = (run / PROFILES_DIR).resolve()
    target = (run / rel).resolve()
    if os.path.isabs(rel) or root not in target.parents:
        raise ValueError(f"refused: the path leaves {PROFILES_DIR}/ of the run")
    data = target.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("not a Kineto trace (no JSON object)")
    return doc


def _thread_names(kineto: dict[str, Any]) -> dict[tuple[Any, Any], str]:
    names = {}
    for e in kineto.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", e.get("tid")))
    return names


def _track_names(tracks: dict[tuple[int, str], int]) -> list[dict[str, Any]]:
    out = []
    for (pid, name), tid in tracks.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"profiler: {name}"}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": SORT_BASE + TID_STRIDE - 1 - tid % TID_STRIDE}})
    return out


def _write(output: Path, doc: dict[str, Any]) -> None:
    tmp = output.with_name(f".{output.name}.{os.getpid()}.profiles.tmp")
    try:
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            tmp.unlink()
