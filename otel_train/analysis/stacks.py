"""Python stacks of a stuck process: the latest ``stall`` record's (or a py-spy dump's), and which frames to show.

A stack is ``{"tid", "thread", "frames": ["path:line:function", …]}`` with the innermost frame last
(docs/watch.md). Stacks come from trace files, so everything here tolerates malformed values.
"""

from __future__ import annotations

import re
from typing import Any

from otel_train.analysis.spans import ProcessState

_LIBRARY = re.compile(
    r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python\d[\d.]*[/\\]|[/\\]otel_train[/\\]|^<frozen |^<string>"
)
"""Frames of installed packages, the standard library and otel-train itself: not the user's code."""


def stall_stacks(d: ProcessState) -> list[dict[str, Any]] | None:
    """Every thread's stack at ``d``'s latest stall, the stalled thread first; None without stall records.

    Stalls of spans still open win over older ones that resolved.
    """
    if not d.stalls:
        return None
    open_ids = {u.span_id for u in d.unclosed}
    candidates = [r for sid, r in d.stalls.items() if sid in open_ids] or list(d.stalls.values())
    latest = max(candidates, key=lambda r: r.ts)
    attrs = latest.attrs or {}
    stacks = clean_stacks(attrs.get("stacks"))
    if not stacks:
        return None
    tid = attrs.get("tid", latest.tid)
    return sorted(stacks, key=lambda s: s["tid"] != tid)  # stable: the rest keep their order


def clean_stacks(value: Any) -> list[dict[str, Any]]:
    """The well-formed stacks of ``value`` (a list of stack objects), others dropped."""
    if not isinstance(value, list):
        return []
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("frames"), list):
            continue
        out.append({
            "tid": item.get("tid"),
            "thread": str(item.get("thread", "")),
            "frames": [f for f in item["frames"] if isinstance(f, str)],
            **({"owns_gil": True} if item.get("owns_gil") is True else {}),
        })
    return out


def is_user_frame(frame: str) -> bool:
    """Whether ``path:line:function`` is the user's code (not a package, the stdlib or otel-train)."""
    return _LIBRARY.search(frame) is None


def user_frames(frames: list[str], limit: int = 4) -> tuple[list[str], str | None]:
    """(the innermost ``limit`` user frames, innermost last; the innermost frame when it is not the user's)."""
    mine = [f for f in frames if is_user_frame(f)][-limit:]
    inner = frames[-1] if frames and not is_user_frame(frames[-1]) else None
    return (mine or frames[-limit:]), inner


def describe_stack(stack: dict[str, Any], limit: int = 4) -> str:
    """One line for a stack: ``thread: a.py:3:f > b.py:9:g (in re/__init__.py:166:match)``."""
    mine, inner = user_frames(stack.get("frames") or [], limit)
    text = " > ".join(_short(f) for f in mine) or "(no Python frames)"
    if inner is not None and inner not in mine:
        text += f" (in {_short(inner)})"
    return f"{stack.get('thread') or stack.get('tid')}: {text}"


def _short(frame: str) -> str:
    # "path:line:function" with the path cut to its last two parts: enough to recognise a file.
    path, _, rest = frame.rpartition(":")
    path, _, line = path.rpartition(":")
    parts = re.split(r"[/\\]", path)
    return f"{'/'.join(parts[-2:])}:{line}:{rest}" if path else frame
