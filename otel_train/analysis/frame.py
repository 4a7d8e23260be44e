"""Spans as a pandas DataFrame, for notebooks (pandas is imported only when this is called)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.analysis.records import Reader
from otel_train.analysis.spans import iter_processes

if TYPE_CHECKING:
    import pandas

COLUMNS = (
    "source", "rank", "attempt", "host", "pid", "name", "step", "start_ts", "end_ts", "dur_ms",
    "status", "error_type", "error_message", "span_id", "parent_span_id", "trace_id", "tid",
)


def to_dataframe(
    path: str | Path,
    *,
    ranks: set[int] | None = None,
    steps: tuple[int, int] | None = None,
    reader: Reader | None = None,
) -> pandas.DataFrame:
    """One row per span of the run at ``path`` (columns: ``COLUMNS``; ``attrs`` flattened as ``attr.<key>``).

    Open spans have NaN ``end_ts``/``dur_ms``. Raises TraceReadError for a path without trace files
    and ImportError when pandas is missing.
    """
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("to_dataframe needs pandas: pip install 'otel-train[analysis]'") from None
    rows: list[dict[str, Any]] = []
    for trace in iter_processes(path, reader or Reader(), ranks=ranks, steps=steps):
        for s in trace.spans:
            row = {
                "source": trace.source, "rank": trace.rank, "attempt": trace.attempt, "host": trace.host,
                "pid": trace.pid, "name": s.name, "step": s.step, "start_ts": s.start_ts, "end_ts": s.end_ts,
                "dur_ms": s.dur_ms, "status": s.status,
                "error_type": (s.error or {}).get("type"), "error_message": (s.error or {}).get("message"),
                "span_id": s.span_id, "parent_span_id": s.parent_span_id, "trace_id": s.trace_id, "tid": s.tid,
            }
            row.update({f"attr.{k}": v for k, v in (s.attrs or {}).items()})
            rows.append(row)
    frame = pd.DataFrame(rows, columns=None if rows else list(COLUMNS))
    if rows:
        frame["step"] = frame["step"].astype("Int64")
    return frame
