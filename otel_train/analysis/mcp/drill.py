"""The MCP tools that go down to one op, one span, or raw rows (docs/mcp.md, "Tools"): ``query``,
``span_details``, ``collective``, ``export``. All read through the query views (:mod:`..query`), the
same read-only, capped DuckDB connection the CLI's ``query`` uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from otel_train.analysis.mcp.roots import Roots
from otel_train.analysis.mcp.tools import DEFAULT_ROWS, MAX_ROWS, QUERY_TIMEOUT_S, _quiet, _window, hint


def _rows(roots: Roots, run_dir: Path, sql: str, params: list[Any] | None = None, *, max_rows: int = MAX_ROWS,
          steps: tuple[int, int] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """(rows as objects, truncated) of ``sql`` over the run's views (dumps read only inside the roots)."""
    from otel_train.analysis.query import open_views, run_sql
    from otel_train.analysis.query.render import records

    con = open_views(run_dir, warn=_quiet, steps=steps, sql=sql, dumps_allowed=roots.inside)
    try:
        if params:
            cur = con.execute(sql, params)
            cols = [d[0] for d in cur.description or ()]
            kinds = [str(d[1]) for d in cur.description or ()]
            got = cur.fetchmany(max_rows + 1)
            from otel_train.analysis.query.engine import Result

            res = Result(cols, kinds, got[:max_rows], len(got) > max_rows)
        else:
            res = run_sql(con, sql, timeout_s=QUERY_TIMEOUT_S, max_rows=max_rows)
    finally:
        con.close()
    return records(res), res.truncated


def query(roots: Roots, run: str, sql: str, max_rows: int = DEFAULT_ROWS, steps: str | None = None) -> dict[str, Any]:
    run_dir = roots.run(run)
    cap = max(1, min(int(max_rows), MAX_ROWS))
    rows, truncated = _rows(roots, run_dir, sql, max_rows=cap, steps=_window(steps))
    out: dict[str, Any] = {"run": str(run_dir), "rows": rows, "row_count": len(rows), "truncated": truncated}
    if truncated:
        out["note"] = f"more than {cap} rows: only the first {cap} are here; add a WHERE, an ORDER BY and a LIMIT"
    ids = [r["span_id"] for r in rows if isinstance(r.get("span_id"), str)][:1]
    out["next"] = ([hint("span_details", "one of these spans in full: its parent, children, records",
                         run=str(run_dir), span_id=ids[0])] if ids else
                   [hint("query", "views and columns: DESCRIBE a view", run=str(run_dir), sql="DESCRIBE spans")])
    return out


SPAN_SQL = "SELECT * FROM spans WHERE span_id = ? AND (? IS NULL OR rank = ?) ORDER BY rank, attempt LIMIT 5"
CHILD_SQL = ("SELECT name, count(*) AS n, sum(dur_ms) AS ms, bool_or(incomplete) AS any_open FROM spans "
             "WHERE parent_span_id = ? AND rank = ? AND attempt = ? GROUP BY name ORDER BY ms DESC NULLS FIRST LIMIT 30")
INSTANT_SQL = "SELECT * FROM instants WHERE span_id = ? AND rank = ? AND attempt = ? ORDER BY ts LIMIT 20"
COMM_SQL = "SELECT * FROM comm WHERE span_id = ? AND rank = ? AND attempt = ? LIMIT 1"


def span_details(roots: Roots, run: str, span_id: str, rank: int | None = None) -> dict[str, Any]:
    run_dir = roots.run(run)
    spans, _ = _rows(roots, run_dir, SPAN_SQL, [span_id, rank, rank])
    if not spans:
        return {"run": str(run_dir), "error": f"no span {span_id!r}" + (f" on rank {rank}" if rank is not None else ""),
                "next": [hint("query", "find span ids", run=str(run_dir),
                              sql="SELECT rank, step, name, span_id, dur_ms FROM spans ORDER BY dur_ms DESC LIMIT 20")]}
    span = spans[0]
    key = [span_id, span["rank"], span["attempt"]]
    parent, _ = (_rows(roots, run_dir, SPAN_SQL, [span["parent_span_id"], span["rank"], span["rank"]])
                 if span.get("parent_span_id") else ([], False))
    children, _ = _rows(roots, run_dir, CHILD_SQL, key)
    instants, _ = _rows(roots, run_dir, INSTANT_SQL, key)
    comm, _ = _rows(roots, run_dir, COMM_SQL, key)
    out = {"run": str(run_dir), "span": span, "parent": parent[0] if parent else None, "children": children,
           "instants": instants, "comm": comm[0] if comm else None, "also_on_ranks": [s["rank"] for s in spans[1:]]}
    nxt = []
    if comm:
        nxt.append(hint("collective", "this op across its group", run=str(run_dir), group=comm[0]["group"],
                        seq=comm[0]["seq"], attempt=span["attempt"]))
    if parent:
        nxt.append(hint("span_details", "the parent span", run=str(run_dir), span_id=span["parent_span_id"],
                        rank=span["rank"]))
    nxt.append(hint("query", "the same span name on every rank at this step", run=str(run_dir),
                    sql=f"SELECT rank, dur_ms, status FROM spans WHERE name = '{_sq(span['name'])}' AND step "
                        f"{'IS NULL' if span['step'] is None else '= ' + str(int(span['step']))} ORDER BY dur_ms DESC"))
    out["next"] = nxt
    return out


def _sq(text: str) -> str:
    return text.replace("'", "''")


COLLECTIVE_SQL = ("SELECT rank, attempt, step, op, peer, bytes, dtype, arrive_ts, end_ts, wait_ms, transfer_ms, "
                  "last_arrival, status, span_id, phase, \"desc\" FROM comm WHERE \"group\" = ? AND seq = ? "
                  "AND (? IS NULL OR attempt = ?) ORDER BY attempt, arrive_ts NULLS LAST, rank")


def collective(roots: Roots, run: str, group: str, seq: int, attempt: int | None = None) -> dict[str, Any]:
    from otel_train.analysis.spans import load_run

    run_dir = roots.run(run)
    ops, truncated = _rows(roots, run_dir, COLLECTIVE_SQL, [str(group), int(seq), attempt, attempt])
    graphs = load_run(run_dir, warn=_quiet).comm
    graph = next((g for (_, a), g in sorted(graphs.items(), key=lambda kv: -kv[0][1])
                  if attempt is None or a == attempt), None)
    members = list(graph.members(str(group))) if graph is not None else []
    issued = {o["rank"] for o in ops}
    arrived = [o for o in ops if o["arrive_ts"] is not None]
    last = max(arrived, key=lambda o: o["arrive_ts"]) if arrived else None
    missing = [m for m in members if m not in issued]
    waiting = [o["rank"] for o in ops if o["end_ts"] is None]
    out = {"run": str(run_dir), "group": str(group), "seq": int(seq), "desc": ops[0]["desc"] if ops else None,
           "members": members, "arrivals": ops, "missing": missing, "waiting": waiting, "truncated": truncated,
           "ops_issued": sorted({o["op"] for o in ops})}
    if missing:
        out["who_waited_for_whom"] = f"ranks {waiting or sorted(issued)} wait for ranks {missing}, which never issued it"
    elif last is not None:
        out["who_waited_for_whom"] = f"every member waited for rank {last['rank']}, the last to arrive"
    culprit = missing[0] if missing else (last["rank"] if last is not None else None)
    out["next"] = ([hint("query", "what the culprit was doing then", run=str(run_dir),
                         sql=f"SELECT step, name, start_ts, dur_ms, status FROM spans WHERE rank = {culprit} "
                             "ORDER BY start_ts DESC LIMIT 20")] if culprit is not None else [])
    if ops and ops[0].get("span_id"):
        out["next"].append(hint("span_details", "one member's op span", run=str(run_dir), span_id=ops[0]["span_id"],
                                rank=ops[0]["rank"]))
    return out


def export(roots: Roots, run: str, format: str = "perfetto", steps: str | None = None) -> dict[str, Any]:  # noqa: A002
    from otel_train.analysis.export import export as export_run

    if format not in ("perfetto", "chrome"):
        raise ValueError(f"format {format!r}: perfetto or chrome")
    run_dir = roots.run(run)
    out_dir = roots.output_dir(run_dir)
    target = out_dir / ("structured_trace.pftrace" if format == "perfetto" else "structured_trace.json")
    if target.is_symlink():
        raise ValueError(f"{target.name} in {run_dir.name}/analysis is a link: refused")
    from otel_train.analysis.query import dumps_dir
    from otel_train.analysis.spans import load_run

    fr = dumps_dir(run_dir, load_run(run_dir, warn=_quiet), roots.inside)
    result = export_run(run_dir, format, target, steps=_window(steps), fr=fr)
    return {"run": str(run_dir), "path": str(target), "format": format, "bytes": target.stat().st_size,
            "slices": getattr(result, "slices", None),
            "next": [hint("findings", "open the file in ui.perfetto.dev; the findings name where to look",
                          run=str(run_dir))]}
