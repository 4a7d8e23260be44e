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
    scan = _Scan()
    for i, ev in enumerate(events):
        scan.event(i, ev)
    problems = scan.problems + scan.naming_problems()
    for (pid, tid), spans in scan.intervals.items():
        problems += _nesting_problems(pid, tid, spans, epsilon_us)
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more problems"]
    return problems


class _Scan:
    """One pass over the events: per-event problems, names given, tracks used, slices per track."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.named_pids: set[Any] = set()
        self.named_tids: set[tuple[Any, Any]] = set()
        self.used_tids: dict[tuple[Any, Any], int] = {}  # first event index on each (pid, tid)
        self.intervals: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
        self.open_b: dict[tuple[Any, Any], list[tuple[float, str]]] = {}

    def event(self, i: int, ev: Any) -> None:
        if not isinstance(ev, dict):
            self.problems.append(f"event {i}: not an object")
            return
        ph = ev.get("ph")
        name = str(ev.get("name", ""))
        where = f"event {i} ({ph} {name!r})"
        if not isinstance(ph, str) or not ph:
            self.problems.append(f"{where}: missing phase \"ph\"")
        elif ph == "M":
            self._metadata(ev, name)
        elif ph in _TIMED_PHASES and not _finite(ev.get("ts")):
            self.problems.append(f"{where}: ts {ev.get('ts')!r} is not a finite number")
        elif ph == "C":
            self._counter(i, ev, where)
        else:
            self._slice(i, ev, ph, name, where)

    def _metadata(self, ev: dict, name: str) -> None:
        args = ev.get("args")
        if not (isinstance(args, dict) and isinstance(args.get("name"), str)):
            return
        if name == "process_name":
            self.named_pids.add(ev.get("pid"))
        elif name == "thread_name":
            self.named_tids.add((ev.get("pid"), ev.get("tid")))

    def _counter(self, i: int, ev: dict, where: str) -> None:
        args = ev.get("args")
        if not isinstance(args, dict) or not args:
            self.problems.append(f"{where}: counter without args")
        else:
            self.problems += [f"{where}: counter value {k}={v!r} is not a finite number"
                              for k, v in args.items() if not _finite(v)]
        self.used_tids.setdefault((ev.get("pid"), None), i)

    def _slice(self, i: int, ev: dict, ph: str, name: str, where: str) -> None:
        pid, tid = ev.get("pid"), ev.get("tid")
        ts = ev.get("ts", 0)
        if ph in _SLICE_PHASES or (ph in ("i", "I") and ev.get("s", "t") == "t"):
            self.used_tids.setdefault((pid, tid), i)
        if ph == "X":
            dur = ev.get("dur")
            if not _finite(dur) or dur < 0:
                self.problems.append(f"{where}: dur {dur!r} must be a finite number >= 0")
                return
            self.intervals.setdefault((pid, tid), []).append((ts, ts + dur, name))
        elif ph == "B":
            self.open_b.setdefault((pid, tid), []).append((ts, name))
        elif ph == "E":
            stack = self.open_b.get((pid, tid))
            if not stack:
                self.problems.append(f"{where}: end event without a matching begin on pid {pid} tid {tid}")
                return
            start, bname = stack.pop()
            self.intervals.setdefault((pid, tid), []).append((start, ts, bname))

    def naming_problems(self) -> list[str]:
        """Every pid, and every (pid, tid) with a tid, carrying events must be named by metadata."""
        out = []
        named_pids = set(self.named_pids)
        for (pid, tid), first in self.used_tids.items():
            if pid not in named_pids:
                out.append(f"event {first}: pid {pid} has no process_name metadata")
                named_pids.add(pid)  # one report per pid
            if tid is not None and (pid, tid) not in self.named_tids:
                out.append(f"event {first}: pid {pid} tid {tid} has no thread_name metadata")
        return out


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
