"""SQL over a run: read-only DuckDB views of the one model (docs/query.md).

:func:`open_views` gives a DuckDB connection holding the run's views (``spans``, ``comm``, ``steps``,
``processes``, ``scalars``, ``instants``, ``findings``, ``clock``), locked for reading only;
:func:`~.engine.run_sql` runs one checked statement on it with a time cap and a row cap.

The views come in two groups (:data:`~.engine.GROUPS`), built only when a statement names one of
their views: ``records`` (spans, steps, scalars, instants) need every span kept, a full read through
the span model; ``model`` (comm, processes, findings, clock) only the compact run ``summarize`` reads,
which the read cache serves. Each group is built once per state of the run's files and kept as a
DuckDB database in the run's read cache (``<hash>.duckdb`` beside its entries), attached read-only
while the files are the same bytes (:class:`~otel_train.analysis.reading.cache.Recall`); a run still
being written is read as it is on disk now, its open spans as ``incomplete`` rows, and built again on
the next query.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.analysis.query.engine import (GROUPS, LOCKED, VIEWS, QueryRefused, Result, build, lock, run_sql,
                                              schema_rows)
from otel_train.analysis.records import Warn, logs_dir, warn_to_stderr

if TYPE_CHECKING:
    import duckdb

    from otel_train.analysis.reading.cache import Recall

VERSION = 2
"""The views' layout: a cached database of another layout is never served."""

Tables = dict[str, dict[str, Any]]

CATALOG_WORDS = {"information_schema", "duckdb_tables", "duckdb_columns", "duckdb_views", "show_tables", "tables",
                 "show", "describe", "summarize"}
"""Words of a statement that lists or describes what is there: every group is built for it."""


def groups_named(sql: str | None) -> list[str]:
    """The view groups ``sql`` names (any word that is a view's name: more is harmless); every group
    without a statement (the schema); ``model`` (the cheap one) for a statement naming no view."""
    words = set(re.findall(r"[a-z_]+", sql.lower())) if sql is not None else set()
    if sql is None or words & CATALOG_WORDS:
        return list(GROUPS)
    return [g for g, views in GROUPS.items() if words & set(views)] or ["model"]


def compute_tables(path: str | Path, steps: tuple[int, int] | None, warn: Warn, groups: list[str],
                   cache: bool = True, dumps_allowed: Callable[[Path], bool] | None = None) -> dict[str, Tables]:
    """Each group's view columns for the run at ``path``: the records group by one read through the
    span model (which also gives the run), else the compact run (the read cache serves it); the model
    group from the run's comm graphs and its summarize object (Flight Recorder dumps merged: from the
    run's recorded ``fr_dir`` unless ``dumps_allowed`` refuses it, then from ``<run>/flight_recorder``)."""
    from otel_train.analysis.query.views import model_tables, record_tables
    from otel_train.analysis.summary import default_fr, summarize_run, with_dumps

    out: dict[str, Tables] = {}
    if "records" in groups:
        from otel_train.analysis.query.load import load_for_views

        loaded = load_for_views(path, warn=warn, steps=steps)
        run = with_dumps(loaded.run, dumps_dir(path, loaded.run, dumps_allowed), warn)
        out["records"] = record_tables(loaded)
    else:
        from otel_train.analysis.spans import load_run

        run = load_run(path, warn=warn, steps=steps, cache=cache)
        run = with_dumps(run, dumps_dir(path, run, dumps_allowed), warn)
    if "model" in groups:
        out["model"] = model_tables(run, summarize_run(run))
    return out


def dumps_dir(path: str | Path, run: Any, allowed: Callable[[Path], bool] | None) -> Path:
    """Where the run's Flight Recorder dumps are read from: its recorded ``fr_dir`` (``default_fr``),
    or ``<run>/flight_recorder`` when ``allowed`` refuses that (a folder outside an MCP server's roots)."""
    from otel_train.analysis.summary import FR_DIR, default_fr

    fr = default_fr(path, run)
    if allowed is None or allowed(fr):
        return fr
    logs = logs_dir(path)
    return (logs.parent if logs.name == "structured_logs" else logs) / FR_DIR


def _db(recall: Recall) -> Path | None:
    entry = recall.entry() if recall.enabled else None
    return entry.with_suffix(".duckdb") if entry is not None else None


def open_views(path: str | Path, *, steps: tuple[int, int] | None = None, warn: Warn | None = None,
               cache: bool = True, run_id: str | None = None, sql: str | None = None,
               dumps_allowed: Callable[[Path], bool] | None = None) -> duckdb.DuckDBPyConnection:
    """A read-only, locked DuckDB connection holding the views of the run at ``path`` that ``sql``
    names (all of them without ``sql``), only steps ``steps`` (inclusive) when given. ``cache`` False:
    neither served from nor kept in the read cache; ``run_id``: the run chosen (``--run-id``, already
    set by ``use_run``), part of the cache's key; ``dumps_allowed``: whether the run's recorded Flight
    Recorder folder may be read (:func:`compute_tables`). Raises TraceReadError without trace files."""
    from otel_train.analysis.reading.cache import Recall

    say: Callable[[str], None] = warn or warn_to_stderr
    logs = [logs_dir(path)]
    key = {"steps": steps, "run_id": run_id, "v": VERSION, "dumps_checked": dumps_allowed is not None}
    wanted = groups_named(sql) if sql is not None else list(GROUPS)
    recalls = {g: Recall(f"query-{g}", logs, key, enabled=cache) for g in ("records", "model")}
    files: dict[str, Path] = {}
    for g in wanted:
        db, hit = _db(recalls[g]), None
        hit = recalls[g].recall() if db is not None else None
        if hit is not None and hit[0] == db.name and db.exists():  # type: ignore[union-attr]
            files[g] = db  # type: ignore[assignment]
            for line in hit[1]:
                say(line)
    missing = [g for g in wanted if g not in files]
    if "records" in missing and "model" not in files:
        missing = ["records", "model"]  # the full read gives the run too: the model views cost little more
    built: dict[str, Tables] = {}
    if missing:
        built = _compute(path, steps, say, missing, recalls, cache, dumps_allowed)
        for g in list(built):
            db = _kept(_db(recalls[g]), built[g], recalls[g])
            if db is not None:
                files[g] = db
                del built[g]
    try:
        return _connect(files, built)
    except _Broken as exc:  # a kept database that cannot be attached (truncated, damaged): a miss, once
        exc.path.unlink(missing_ok=True)
        if not exc.path.name.endswith(".duckdb") or missing:
            raise QueryRefused(f"the read cache's views database {exc.path} cannot be read: run again") from None
        return open_views(path, steps=steps, warn=warn, cache=cache, run_id=run_id, sql=sql,
                          dumps_allowed=dumps_allowed)


class _Broken(Exception):
    """A kept views database DuckDB cannot attach."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def _compute(path: str | Path, steps: tuple[int, int] | None, say: Callable[[str], None], groups: list[str],
             recalls: dict[str, Recall], cache: bool, dumps_allowed: Callable[[Path], bool] | None
             ) -> dict[str, Tables]:
    """:func:`compute_tables` inside one recording; every group's recall takes that recording's
    inputs (the same read made them all)."""
    heard: list[str] = []

    def note(line: str) -> None:
        heard.append(line)
        say(line)

    first = recalls[groups[0]]
    with first.recording():
        out = compute_tables(path, steps, note, groups, cache, dumps_allowed)
    for g in groups:
        r = recalls[g]
        r.inputs, r.outputs, r.too_big = list(first.inputs), list(first.outputs), first.too_big
        r.heard = heard  # type: ignore[attr-defined]
    return out


def _kept(db: Path | None, tables: Tables, recall: Recall) -> Path | None:
    """Build ``tables`` into ``db`` (a temporary renamed into place) and remember it; None without a
    cache or when the file cannot be written (the tables are then built in memory)."""
    if db is None:
        return None
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
        return None
    recall.keep(db.name, getattr(recall, "heard", []))
    return db


def _connect(files: dict[str, Path], built: dict[str, Tables]) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with each group's database attached read-only (and the groups that could
    not be kept built in it), every view found by its bare name, then locked."""
    import duckdb

    con = duckdb.connect()
    for g, db in files.items():
        quoted = str(db).replace("'", "''")
        try:
            con.execute(f"ATTACH '{quoted}' AS {g} (READ_ONLY)")
            con.execute(f"SELECT count(*) FROM duckdb_tables() WHERE database_name = '{g}'").fetchall()
        except duckdb.Error:
            con.close()
            raise _Broken(db) from None
    for tables in built.values():
        build(con, tables)
    con.execute(f"SET search_path = '{','.join(['main', *files])}'")
    lock(con)
    return con


__all__ = ["GROUPS", "LOCKED", "VIEWS", "QueryRefused", "Result", "compute_tables", "dumps_dir", "groups_named", "open_views",
           "run_sql", "schema_rows"]
