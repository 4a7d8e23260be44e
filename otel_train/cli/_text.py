"""Text from trace files is data: never markup, never terminal control (docs/cli.md, "Output").

Span names, messages, stacks and host names come from files anyone who can run code in the job
could have written. Every command prints through :func:`console` (no markup, no highlighting, no
emoji codes) and passes what it prints through :func:`clean`, which writes control characters as
visible escapes:

* C0 controls but tab and newline, DEL and C1 controls (ESC starts ANSI/OSC sequences: clipboard
  writes, screen clears, hyperlinks);
* bidirectional overrides and isolates (text that reads differently than it is);
* lone surrogates (they cannot be encoded at all);
* text longer than :data:`MAX_CHARS` is cut, with the length said.

When stdout is not a terminal (a pipe, ``tee``, a CI log), tables are printed at their natural width
(or ``COLUMNS``), never wrapped mid-word at 80 columns.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console

MAX_CHARS = 2000
"""Longest text printed from a trace file in text mode (names, messages); the rest is cut."""

NATURAL_WIDTH = 100_000
"""Console width when the output is not a terminal and COLUMNS is unset: tables at natural width."""

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, limit: int | None = MAX_CHARS) -> str:
    """``text`` with every unsafe character written as a visible escape (``\\x1b``), cut at ``limit``."""
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}… ({len(text)} characters)"
    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else text


def clean(obj: Any, limit: int | None = MAX_CHARS) -> Any:
    """A copy of ``obj`` (JSON-like: dicts, lists, tuples, scalars) with every string :func:`printable`,
    dict keys included."""
    if isinstance(obj, str):
        return printable(obj, limit)
    if isinstance(obj, dict):
        return {clean(k, limit): clean(v, limit) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v, limit) for v in obj]
    return obj


_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def json_safe(text: str) -> str:
    """Encoded JSON text with the characters JSON leaves raw but a terminal acts on (DEL, C1 controls,
    bidi controls) written as ``\\uXXXX`` escapes: the same JSON value, nothing raw on the screen."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _UNSAFE_IN_JSON.search(text) else text


def console(stderr: bool = False) -> Console:
    """A console that prints text as text: no markup, no highlighting, no emoji codes; at the natural
    width (or ``COLUMNS``) when its stream is not a terminal."""
    stream: TextIO = sys.stderr if stderr else sys.stdout
    from rich.console import Console  # imported here: a command that prints no table never loads rich

    width: int | None = None
    if os.environ.get("COLUMNS", "").isdigit():
        width = int(os.environ["COLUMNS"])
    elif not stream.isatty():
        width = NATURAL_WIDTH
    return Console(file=stream, markup=False, highlight=False, emoji=False, width=width, soft_wrap=stderr)
