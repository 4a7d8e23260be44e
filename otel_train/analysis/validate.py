"""Check a Chrome trace JSON against the rules Perfetto and chrome://tracing rely on.

Usable on any Chrome trace, not only ours: ``validate_chrome_trace(path_or_obj)`` returns a list of
one-line problems (empty when the trace is sound). The rules: every event is an object with a
phase; timed events have a finite numeric ``ts``; complete events (``X``) have a finite ``dur >= 0``;
on each (pid, tid) track, slices (``X`` and matched ``B``/``E``) are strictly nested (disjoint, or one
inside the other, within ``epsilon_us`` for float microseconds) since viewers drop or spill
overlapping slices; every pid and (pid, tid) that carries events is named by ``process_name`` /
``thread_name`` metadata; counter (``C``) values are finite numbers.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

EPSILON_US = 1e-3
MAX_PROBLEMS = 50
_SLICE_PHASES = {"X", "B", "E"}
_TIMED_PHASES = {"X", "B", "E", "i", "I", "C", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"}


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def load_chrome_trace(path: str | Path) -> Any:
    """Parse a Chrome trace file (``.json`` or ``.json.gz``); raises ValueError with a one-line reason."""
    p = Path(path)
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt", encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None


def validate_chrome_trace(trace: Any, *, epsilon_us: float = EPSILON_US, limit: int = MAX_PROBLEMS) -> list[str]:
    """Problems found in a Chrome trace (a path, a parsed object, or a list of events); [] if none."""
    if isinstance(trace, (str, Path)):
        try:
            trace = load_chrome_trace(trace)
        except ValueError as exc:
            return [str(exc)]
    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            return ['no "traceEvents" list at the top level']
    elif isinstance(trace, list):
        events = trace
    else:
        return [f"a Chrome trace is a JSON object or array, got {type(trace).__name__}"]

    problems: list[str] = []
    named_pids: set[Any] = set()
    named_tids: set[tuple[Any, Any]] = set()
    used_tids: dict[tuple[Any, Any], int] = {}
    intervals: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    open_b: dict[tuple[Any, Any], list[tuple[float, str]]] = {}

    for i, ev in enumerate(events):
        where = f"event {i}"
        if not isinstance(ev, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = ev.get("ph")
        name = str(ev.get("name", ""))
        where = f"event {i} ({ph} {name!r})"
        if not isinstance(ph, str) or not ph:
            problems.append(f"{where}: missing phase \"ph\"")
            continue
        pid, tid = ev.get("pid"), ev.get("tid")
        if ph == "M":
            args = ev.get("args")
            if name == "process_name" and isinstance(args, dict) and isinstance(args.get("name"), str):
                named_pids.add(pid)
            elif name == "thread_name" and isinstance(args, dict) and isinstance(args.get("name"), str):
                named_tids.add((pid, tid))
            continue
        if ph in _TIMED_PHASES and not _finite(ev.get("ts")):
            problems.append(f"{where}: ts {ev.get('ts')!r} is not a finite number")
            continue
        ts = ev.get("ts", 0)
        if ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args:
                problems.append(f"{where}: counter without args")
            else:
                problems += [f"{where}: counter value {k}={v!r} is not a finite number"
                             for k, v in args.items() if not _finite(v)]
            used_tids.setdefault((pid, None), i)
            continue
        if ph in _SLICE_PHASES or (ph in ("i", "I") and ev.get("s", "t") == "t"):
            used_tids.setdefault((pid, tid), i)
        if ph == "X":
            dur = ev.get("dur")
            if not _finite(dur) or dur < 0:
                problems.append(f"{where}: dur {dur!r} must be a finite number >= 0")
                continue
            intervals.setdefault((pid, tid), []).append((ts, ts + dur, name))
        elif ph == "B":
            open_b.setdefault((pid, tid), []).append((ts, name))
        elif ph == "E":
            stack = open_b.get((pid, tid))
            if not stack:
                problems.append(f"{where}: end event without a matching begin on pid {pid} tid {tid}")
                continue
            start, bname = stack.pop()
            intervals.setdefault((pid, tid), []).append((start, ts, bname))

    for (pid, tid), first in used_tids.items():
        if pid not in named_pids:
            problems.append(f"event {first}: pid {pid} has no process_name metadata")
            named_pids.add(pid)  # one report per pid
        if tid is not None and (pid, tid) not in named_tids:
            problems.append(f"event {first}: pid {pid} tid {tid} has no thread_name metadata")
    for (pid, tid), spans in intervals.items():
        problems += _nesting_problems(pid, tid, spans, epsilon_us)

    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more problems"]
    return problems


def _nesting_problems(pid: Any, tid: Any, spans: list[tuple[float, float, str]], eps: float) -> list[str]:
    """Partial overlaps on one track: a slice that starts inside another but ends after it."""
    out = []
    stack: list[tuple[float, float, str]] = []
    for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][1] <= start + eps:
            stack.pop()
        if stack and end > stack[-1][1] + eps:
            ps, pe, pn = stack[-1]
            out.append(
                f"pid {pid} tid {tid}: {name!r} [{start}, {end}] partially overlaps {pn!r} [{ps}, {pe}] "
                "(put concurrent work on separate tids)"
            )
            continue
        stack.append((start, end, name))
    return out
