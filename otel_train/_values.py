"""User values made safe to write: bounded, printable, valid UTF-8, and never raising.

Span names, attributes, tags and exception messages come from user code: a lone surrogate (a file
name decoded with ``os.fsdecode``), a circular dict, a 5,000-deep list or an object whose ``__str__``
raises must neither break training nor lose the record (README.md, "Output"). These helpers run
on the slow path only: the JSONL encoder tries its fast encoding first and falls back to
:func:`json_safe` when that fails; attributes bound for the OTel SDK go through :func:`otel_attributes`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from otel_train._report import safe_str

__all__ = ["clean_text", "json_safe", "otel_attributes", "safe_str", "MAX_DEPTH", "MAX_ITEMS", "MAX_TEXT"]

MAX_DEPTH = 16
"""Containers nested deeper than this are written as a marker."""
MAX_ITEMS = 1000
"""Items kept per container (a marker says how many more there were)."""
MAX_TEXT = 16384
"""Characters kept of a value converted to text (``str()`` of an object, a too-deep container)."""

DEPTH_MARKER = "<nested too deep>"
_SURROGATE = re.compile("[\ud800-\udfff]")
_INT64 = (-(2**63), 2**63 - 1)


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD, so it encodes as UTF-8."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def _text_of(value: object) -> str:
    return clean_text(safe_str(value, MAX_TEXT))


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that JSON can hold: str (clean), int, float, bool, None, lists, dicts with
    str keys; nested at most ``MAX_DEPTH`` deep, ``MAX_ITEMS`` per container; anything else as text."""
    return _clean(value, 0, False)


def otel_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attributes the OTel SDK takes and OTLP encodes without raising: the same bounds as
    :func:`json_safe`, sequences as tuples, bytes kept, integers outside int64 as text."""
    if not attributes:
        return None
    return _clean(attributes, 0, True)


def _clean(value: Any, depth: int, otel: bool) -> Any:
    kind = type(value)
    if value is None or kind is bool or kind is float:
        return value
    if kind is str:
        return clean_text(value)
    if kind is int:
        return value if not otel or _INT64[0] <= value <= _INT64[1] else str(value)
    if kind is bytes and otel:
        return value
    if isinstance(value, (bool, int, float)):  # IntEnum, numpy.float64 and other subclasses
        return _clean(bool(value) if isinstance(value, bool) else
                      int(value) if isinstance(value, int) else float(value), depth, otel)
    if depth >= MAX_DEPTH:
        return DEPTH_MARKER
    try:
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for i, (key, item) in enumerate(value.items()):
                if i == MAX_ITEMS:
                    out["..."] = f"{len(value) - MAX_ITEMS} more"
                    break
                out[clean_text(key) if isinstance(key, str) else _text_of(key)] = _clean(item, depth + 1, otel)
            return out
        if isinstance(value, (list, tuple, set, frozenset)):
            items = [_clean(item, depth + 1, otel) for item, _ in zip(value, range(MAX_ITEMS))]
            if len(value) > MAX_ITEMS:
                items.append(f"... {len(value) - MAX_ITEMS} more")
            return tuple(items) if otel else items
    except Exception:  # noqa: BLE001 - a container whose iteration raises: its text, if it has one
        pass
    return _text_of(value)
