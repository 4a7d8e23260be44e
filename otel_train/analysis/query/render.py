"""A query's answer as text: CSV, JSON (one object per row), or cells for a table (docs/query.md).

Values from trace files stay data: JSON columns are decoded into JSON values (never re-parsed as
markup), and a table's cells are plain strings the CLI prints through its escaping.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any

import msgspec

from otel_train.analysis.query.engine import Result


def _plain(value: Any, kind: str) -> Any:
    """A value as JSON holds it: JSON columns decoded, NaN and infinities null, bytes as text."""
    if value is None:
        return None
    if kind == "JSON" and isinstance(value, str):
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError:
            return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): _plain(v, "") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, "") for v in value]
    if isinstance(value, (int, float, str, bool)):
        return value
    return str(value)  # dates, decimals, UUIDs: as DuckDB prints them


def records(result: Result) -> list[dict[str, Any]]:
    """The rows as objects keyed by column name (JSON columns decoded)."""
    return [{c: _plain(v, k) for c, k, v in zip(result.columns, result.types, row)} for row in result.rows]


def to_json(result: Result) -> str:
    """A JSON array of row objects, one line, then a newline."""
    return msgspec.json.encode(records(result)).decode() + "\n"


def cell(value: Any) -> str:
    """One value as a table or CSV cell: null empty in CSV, ``NULL`` in a table (see :func:`table_cells`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "" if not math.isfinite(value) else repr(value)
    if isinstance(value, (dict, list, tuple)):
        return msgspec.json.encode(_plain(value, "")).decode()
    return str(value)


def to_csv(result: Result) -> str:
    """CSV text with a header row; nulls as empty cells."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(result.columns)
    for row in result.rows:
        writer.writerow(["" if v is None else cell(v) for v in row])
    return out.getvalue()


def table_cells(result: Result) -> list[list[str]]:
    """Each row's cells for a text table (nulls as ``NULL``; floats to 6 significant places)."""
    def short(v: Any) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, float) and math.isfinite(v):
            return f"{v:.6f}" if abs(v) >= 1e9 else f"{v:.6g}"
        return cell(v)

    return [[short(v) for v in row] for row in result.rows]
