"""SQL over a run: read-only DuckDB views of the one model (docs/query.md).

:func:`open_views` gives a DuckDB connection holding the run's views (``spans``, ``comm``, ``steps``,
``processes``, ``scalars``, ``instants``, ``findings``, ``clock``), locked for reading only;
:func:`~.engine.run_sql` runs one checked statement on it with a time cap and a row cap.

The views are built once per state of the run's files and kept as a DuckDB database in the run's
read cache (``<hash>.duckdb`` beside the cache's entries), served read-only while the files are the
same bytes (:class:`~otel_train.analysis.reading.cache.Recall`); a run still being written is read
as it is on disk now, its open spans as ``incomplete`` rows, and built again on the next query.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.analysis.query.engine import LOCKED, VIEWS, QueryRefused, Result, build, lock, run_sql, schema_rows
from otel_train.analysis.records import Warn, logs_dir, warn_to_stderr

if TYPE_CHECKING:
    import duckdb

VERSION = 1
"""The views' layout: a cached database of another layout is never served."""


def compute_tables(path: str | Path, steps: tuple[int, int] | None, warn: Warn) -> dict[str, dict[str, Any]]:
    """Every view's columns for the run at ``path``: one read through the span model, the run
    assembly, the comm graphs and the findings summarize reports (Flight Recorder dumps merged)."""
    from otel_train.analysis.query.load import load_for_views
    from otel_train.analysis.query.views import tables
    from otel_train.analysis.summary import default_fr, summarize_run, with_dumps

    loaded = load_for_views(path, warn=warn, steps=steps)
    with_dumps(loaded.run, default_fr(path, loaded.run), warn)
    return tables(loaded, summarize_run(loaded.run))


def _open_file(db: Path) -> duckdb.DuckDBPyConnection:
    import duckdb

    return duckdb.connect(str(db), read_only=True, config=dict(LOCKED))


def _in_memory(tables: dict[str, dict[str, Any]]) -> duckdb.DuckDBPyConnection:
    import duckdb

    con = duckdb.connect()
    build(con, tables)
    lock(con)
    return con


def open_views(path: str | Path, *, steps: tuple[int, int] | None = None, warn: Warn | None = None,
               cache: bool = True, run_id: str | None = None) -> duckdb.DuckDBPyConnection:
    """A read-only, locked DuckDB connection holding the views of the run at ``path`` (only steps
    ``steps``, inclusive, when given). ``cache`` False: neither served from nor kept in the read cache; ``run_id``: the run chosen
    (``--run-id``, already set by ``use_run``), part of the cache's key.
    Raises TraceReadError when the path holds no trace files."""
    from otel_train.analysis.reading.cache import Recall

    say: Callable[[str], None] = warn or warn_to_stderr
    recall = Recall("query-views", [logs_dir(path)], {"steps": steps, "run_id": run_id, "v": VERSION}, enabled=cache)
    entry = recall.entry() if cache else None
    db = entry.with_suffix(".duckdb") if entry is not None else None
    hit = recall.recall() if db is not None else None
    if hit is not None and hit[0] == db.name and db.exists():  # type: ignore[union-attr]
        for line in hit[1]:
            say(line)
        return _open_file(db)  # type: ignore[arg-type]
    heard: list[str] = []

    def note(line: str) -> None:
        heard.append(line)
        say(line)

    with recall.recording():
        tables = compute_tables(path, steps, note)
    if db is None:
        return _in_memory(tables)
    return _kept(db, tables, recall, heard)


def _kept(db: Path, tables: dict[str, dict[str, Any]], recall: Any, heard: list[str]) -> duckdb.DuckDBPyConnection:
    """Build the views into ``db`` (a temporary renamed into place) and remember it; in memory when the
    file cannot be written."""
    import duckdb

    tmp = db.with_name(f"{db.name}.{os.getpid()}.tmp")
    try:
        con = duckdb.connect(str(tmp))
        try:
            build(con, tables)
        finally:
            con.close()
        os.replace(tmp, db)
    except (OSError, duckdb.Error):
        tmp.unlink(missing_ok=True)
        return _in_memory(tables)
    recall.keep(db.name, heard)
    return _open_file(db)


__all__ = ["VIEWS", "QueryRefused", "Result", "compute_tables", "open_views", "run_sql", "schema_rows"]
