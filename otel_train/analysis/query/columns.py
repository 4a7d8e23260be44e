"""One process's spans, instants and scalars as columns (docs/query.md, "Views").

A process is read once by the one span model (``read_process(..., keep=True)``); what it kept is
turned here into plain columns (lists and numpy arrays) and then dropped, so the state that goes on to
the run assembly is the compact one every other command uses. Times stay on the process's own clock
here (``raw_*``); the run's clock estimate aligns them later (:mod:`.views`).

Nulls: integer columns use :data:`NULL_INT`, float columns NaN; the views turn both into SQL NULL.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from otel_train.analysis.spans import UNCLOSED, ProcessState

NULL_INT = -(2**62)
"""An integer column's null (no step, no microbatch): a value no record can hold."""

_ENCODE = msgspec.json.Encoder().encode


def _json(value: Any, memo: dict[bytes, str]) -> str | None:
    """``value`` as JSON text (None when empty); equal texts share one string (cheap to ship and scan)."""
    if not value:
        return None
    try:
        raw = _ENCODE(value)
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError):
        raw = _ENCODE(repr(value))
    text = memo.get(raw)
    if text is None:
        text = memo[raw] = raw.decode("utf-8", "replace")
    return text


def _ints(values: list[int | None]) -> np.ndarray:
    """A typed field of the model (step, thread id: ints or None, the decoder checked them) as int64."""
    if values.count(None) == len(values):
        return np.full(len(values), NULL_INT, dtype=np.int64)
    return np.array([NULL_INT if v is None else v for v in values], dtype=np.int64)


def _int_or_null(values: list[Any]) -> np.ndarray:
    """Integers from attributes as int64, anything else (None, a bool, a float, text) as null."""
    if values.count(None) == len(values):
        return np.full(len(values), NULL_INT, dtype=np.int64)
    return np.fromiter((v if type(v) is int and -(2**63) <= v < 2**63 else NULL_INT for v in values),
                       dtype=np.int64, count=len(values))


def _float_or_nan(values: list[Any]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def span_columns(state: ProcessState) -> dict[str, Any]:
    """The ``spans`` rows of one process (status ``open``: no end record yet; ``incomplete``: ended by
    shutdown; both are ``incomplete`` rows)."""
    spans = state.spans
    memo: dict[bytes, str] = {}
    names = {s.span_id: s.name for s in spans}
    attrs = [s.attrs for s in spans]
    status = [s.status for s in spans]
    microbatch = [a.get("microbatch") if a else None for a in attrs]
    return {
        "step": _ints([s.step for s in spans]),
        "name": np.array([s.name for s in spans], dtype=object),
        "parent": np.array([names.get(s.parent_span_id) for s in spans], dtype=object),
        "raw_start_ts": _float_or_nan([s.start_ts for s in spans]),
        "raw_end_ts": _float_or_nan([s.end_ts for s in spans]),
        "status": np.array(status, dtype=object),
        "incomplete": np.fromiter((st in UNCLOSED for st in status), dtype=bool, count=len(status)),
        "microbatch": _int_or_null(microbatch),
        "span_id": np.array([s.span_id for s in spans], dtype=object),
        "parent_span_id": np.array([s.parent_span_id for s in spans], dtype=object),
        "trace_id": np.array([s.trace_id for s in spans], dtype=object),
        "tid": _ints([s.tid for s in spans]),
        "error": np.array([_json(s.error, memo) for s in spans], dtype=object),
        "attrs": np.array([_json(a, memo) for a in attrs], dtype=object),
    }


def instant_columns(state: ProcessState) -> dict[str, Any]:
    """The ``instants`` rows of one process."""
    recs = state.instants
    memo: dict[bytes, str] = {}
    return {
        "step": _ints([r.step for r in recs]),
        "raw_ts": _float_or_nan([r.ts for r in recs]),
        "name": np.array([r.name for r in recs], dtype=object),
        "span_id": np.array([r.span_id for r in recs], dtype=object),
        "attrs": np.array([_json(r.attrs, memo) for r in recs], dtype=object),
    }


def scalar_columns(state: ProcessState) -> dict[str, Any]:
    """The ``scalars`` rows of one process: one row per value (booleans as 0/1; other types left out)."""
    steps: list[Any] = []
    ts: list[float] = []
    keys: list[str] = []
    values: list[float] = []
    for r in state.scalars:
        for key, value in (r.values or {}).items():
            if isinstance(value, (int, float)):
                steps.append(r.step)
                ts.append(r.ts)
                keys.append(key)
                values.append(float(value))
    return {
        "step": _ints(steps),
        "raw_ts": np.array(ts, dtype=np.float64),
        "key": np.array(keys, dtype=object),
        "value": np.array(values, dtype=np.float64),
    }


def take_columns(state: ProcessState) -> dict[str, dict[str, Any]]:
    """The three column sets of a ``keep=True`` state, which is then made compact (``keep`` off, its
    spans, instants and scalars dropped): what the run assembly needs, at the size it always has."""
    out = {"spans": span_columns(state), "instants": instant_columns(state), "scalars": scalar_columns(state)}
    state.spans, state.instants, state.scalars = [], [], []
    state.keep = False
    return out
