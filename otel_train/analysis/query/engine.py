"""SQL over a run's views: DuckDB in process, read-only, no file or network access (docs/query.md).

The views are tables in a DuckDB database built from the model's columns (:mod:`.views`), never
from the JSON files. A statement is run only when DuckDB's own parser says it is one ``SELECT`` (or
``EXPLAIN``/``DESCRIBE`` of one); the connection has ``enable_external_access`` off (no file, no
``ATTACH``, no extension, no ``COPY``) and its configuration locked, and a timer interrupts a
statement at the time cap. Anything refused raises :class:`QueryRefused` with one line.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from otel_train.analysis.query.columns import NULL_INT

if TYPE_CHECKING:
    import duckdb

VIEW_SPECS: dict[str, dict[str, str]] = {
    "spans": {"rank": "int", "attempt": "int", "host": "str", "source": "str", "step": "int", "name": "str",
              "parent": "str", "start_ts": "float", "end_ts": "float", "raw_start_ts": "float",
              "raw_end_ts": "float", "dur_ms": "float", "status": "str", "incomplete": "bool", "microbatch": "int",
              "span_id": "str", "parent_span_id": "str", "trace_id": "str", "tid": "int", "error": "json",
              "attrs": "json"},
    "comm": {"rank": "int", "attempt": "int", "source": "str", "step": "int", "group": "str", "desc": "str",
             "seq": "int", "op": "str", "peer": "int", "bytes": "int", "dtype": "str", "arrive_ts": "float",
             "end_ts": "float", "raw_arrive_ts": "float", "wait_ms": "float", "transfer_ms": "float",
             "last_arrival": "bool", "status": "str", "span_id": "str", "phase": "str", "clock": "str", "from": "str"},
    "processes": {"rank": "int", "attempt": "int", "source": "str", "host": "str", "pid": "int", "world_size": "int",
                  "final_step": "int", "relative_step": "int", "last_event": "str", "last_ts": "float",
                  "open_spans": "list", "ended_cleanly": "bool", "signal": "str", "records": "int"},
    "scalars": {"rank": "int", "attempt": "int", "host": "str", "source": "str", "step": "int", "ts": "float",
                "raw_ts": "float", "key": "str", "value": "float"},
    "instants": {"rank": "int", "attempt": "int", "host": "str", "source": "str", "step": "int", "ts": "float",
                 "raw_ts": "float", "name": "str", "span_id": "str", "attrs": "json"},
    "findings": {"kind": "str", "rank": "int", "attempt": "int", "step": "int", "phase": "str", "message": "str",
                 "victims": "json", "comm": "json", "detail": "json"},
    "clock": {"host": "str", "offset_ms": "float", "drift_ppm": "float", "residual_ms": "float", "samples": "int"},
}
"""Each view built from columns: its columns in order and their kinds (``steps`` is made from ``spans``)."""

STEPS_SQL = """
CREATE TABLE steps AS
SELECT s.rank, s.attempt, s.host, s.source, s.step, s.start_ts, s.end_ts, s.dur_ms, s.status, s.incomplete,
       p.phases_ms, s.span_id
FROM spans s LEFT JOIN (
    SELECT rank, attempt, source, parent_span_id, map(list(name ORDER BY name), list(ms ORDER BY name)) AS phases_ms
    FROM (SELECT rank, attempt, source, parent_span_id, name, sum(dur_ms) AS ms FROM spans
          WHERE parent = 'step' GROUP BY ALL) GROUP BY ALL
) p ON p.rank = s.rank AND p.attempt = s.attempt AND p.source = s.source AND p.parent_span_id = s.span_id
WHERE s.name = 'step' ORDER BY s.rank, s.attempt, s.step
"""
"""``steps``: one row per rank and step (the ``step`` spans), with each phase's time inside it (ms)."""

VIEWS = ("spans", "comm", "steps", "processes", "scalars", "instants", "findings", "clock")
GROUPS = {"records": ("spans", "steps", "scalars", "instants"), "model": ("comm", "processes", "findings", "clock")}
"""The views in two groups, each built, cached and attached on its own: ``records`` need every span kept
(a full read through the span model); ``model`` only the compact run that summarize reads (its cache
serves it)."""
ALLOWED = ("SELECT", "EXPLAIN")
"""Statement types run (DuckDB's parser decides; ``DESCRIBE``, ``SUMMARIZE``, ``FROM t`` parse as SELECT)."""


class QueryRefused(ValueError):
    """A statement that is not one read-only query over the views, or that hit a cap: one line."""


def _expr(name: str, kind: str) -> str:
    col = f'"{name}"'
    if kind == "int":
        return f"nullif({col}, {NULL_INT}) AS {col}"
    if kind == "float":
        return f"CASE WHEN isnan({col}) THEN NULL ELSE {col} END AS {col}"
    if kind == "json":
        return f"CAST({col} AS JSON) AS {col}"
    if kind == "list":
        return f"from_json({col}, '[\"VARCHAR\"]') AS {col}"
    if kind == "bool":
        return f"CAST({col} AS BOOLEAN) AS {col}"
    return f"CAST({col} AS VARCHAR) AS {col}"


def _empty(kind: str) -> Any:
    import numpy as np

    return np.array([], dtype={"int": np.int64, "float": np.float64, "bool": bool}.get(kind, object))


def build(con: duckdb.DuckDBPyConnection, tables: dict[str, dict[str, Any]]) -> None:
    """Create a table in ``con`` for each view in ``tables`` from its columns (numpy arrays); ``steps``
    too when ``spans`` is there."""
    for view, cols in tables.items():
        spec = VIEW_SPECS[view]
        raw = {name: cols[name] if name in cols and len(cols[name]) else _empty(kind) for name, kind in spec.items()}
        con.register("_cols", raw)
        try:
            select = ", ".join(_expr(n, k) for n, k in spec.items())
            con.execute(f'CREATE TABLE "{view}" AS SELECT {select} FROM _cols')
        finally:
            con.unregister("_cols")
    if "spans" in tables:
        con.execute(STEPS_SQL)


LOCKED = {"enable_external_access": False, "autoinstall_known_extensions": False,
          "autoload_known_extensions": False, "memory_limit": "4GB", "lock_configuration": True}
"""What a views connection runs with: no file, network or extension access, no option changed."""


def lock(con: duckdb.DuckDBPyConnection) -> None:
    """Lock an in-memory connection (built first) as :data:`LOCKED` says: what a statement can reach is
    the views."""
    for key, value in LOCKED.items():
        con.execute(f"SET {key} = {value!r}" if isinstance(value, str) else f"SET {key} = {str(value).lower()}")


@dataclass(slots=True)
class Result:
    """A statement's answer: column names and types, rows (at most the row cap), and whether more were cut."""

    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    truncated: bool = False


def check(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise :class:`QueryRefused` unless ``sql`` is one statement of an allowed type."""
    import duckdb

    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryRefused(f"SQL does not parse: {_first_line(exc)}") from None
    if len(statements) != 1:
        raise QueryRefused(f"one statement at a time, got {len(statements)}: run each on its own")
    kind = statements[0].type.name
    if kind not in ALLOWED:
        raise QueryRefused(f"{kind} statements are refused: the views are read-only (SELECT or EXPLAIN only)")


def run_sql(con: duckdb.DuckDBPyConnection, sql: str, *, timeout_s: float | None = None,
            max_rows: int | None = None) -> Result:
    """Check and run ``sql``; at most ``max_rows`` rows (``truncated`` says when more were there); a
    statement still running after ``timeout_s`` is interrupted (:class:`QueryRefused`)."""
    import duckdb

    check(con, sql)
    timer = _interrupt_after(con, timeout_s)
    try:
        cur = con.execute(sql)
        columns = [d[0] for d in cur.description or ()]
        types = [str(d[1]) for d in cur.description or ()]
        rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows + 1)
    except duckdb.InterruptException:
        raise QueryRefused(f"stopped at the time cap ({timeout_s:g} s): narrow the query "
                           "(a WHERE on rank or step, a LIMIT) or raise the cap") from None
    except duckdb.PermissionException as exc:
        raise QueryRefused(f"refused: {_first_line(exc)} (only the views can be read)") from None
    except duckdb.Error as exc:
        raise QueryRefused(f"{type(exc).__name__.replace('Exception', ' error')}: {_first_line(exc)}") from None
    finally:
        if timer is not None:
            timer.cancel()
    truncated = max_rows is not None and len(rows) > max_rows
    return Result(columns, types, rows[:max_rows] if truncated else rows, truncated)


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split("\n", 1)[0].split())


def schema_rows(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str]]:
    """(view, column, type) of every view, in the views' order."""
    rows = con.execute("SELECT table_name, column_name, data_type FROM information_schema.columns "
                       "ORDER BY table_name, ordinal_position").fetchall()
    order = {v: i for i, v in enumerate(VIEWS)}
    return sorted(((str(t), str(c), str(d)) for t, c, d in rows if t in order), key=lambda r: order[r[0]])


def write_parquet(con: duckdb.DuckDBPyConnection, sql: str, path: str, timeout_s: float | None = None) -> int:
    """Run ``sql`` (checked, capped) and write its whole answer as Parquet at ``path`` through a second,
    private connection (the views' connection cannot write files); returns the row count."""
    import duckdb

    check(con, sql)
    timer = _interrupt_after(con, timeout_s)
    try:
        data = con.execute(sql).fetchnumpy()
    except duckdb.InterruptException:
        raise QueryRefused(f"stopped at the time cap ({timeout_s:g} s): narrow the query or raise the cap") from None
    except duckdb.Error as exc:
        raise QueryRefused(_first_line(exc)) from None
    finally:
        if timer is not None:
            timer.cancel()
    from otel_train.analysis.outputs import replacing

    out = duckdb.connect()
    try:
        out.register("result", data)
        with replacing(path, "--output") as f:  # a temporary beside it, renamed: only a regular file replaced
            quoted = f.name.replace("'", "''")
            out.execute(f"COPY (SELECT * FROM result) TO '{quoted}' (FORMAT parquet)")
        return int(out.execute("SELECT count(*) FROM result").fetchone()[0])  # type: ignore[index]
    except duckdb.Error as exc:
        raise QueryRefused(f"cannot write {path} as Parquet: {_first_line(exc)}") from None
    finally:
        out.close()


def _interrupt_after(con: duckdb.DuckDBPyConnection, timeout_s: float | None) -> threading.Timer | None:
    """A started daemon timer that interrupts ``con``'s statement after ``timeout_s`` (None: no cap)."""
    if not timeout_s:
        return None
    timer = threading.Timer(timeout_s, con.interrupt)
    timer.daemon = True
    timer.start()
    return timer
