"""``otel-train query``: the views against summarize and whatif on the same runs, the formats, the step
window, a run still being written, the cache, and hostile SQL (docs/query.md).

Runs here are synthetic (tests/analysis_fixtures.py) with exactly known timings; the real torchrun
runs (clean, straggler, hang while running, desync) are asked through the MCP server's ``query`` tool
in tests/test_mcp.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import base as comm_base
from comm_sim import declare, dp_steps
from sync_sim import base, simulate
from typer.testing import CliRunner

from otel_train.analysis.query import QueryRefused, open_views, run_sql
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize
from otel_train.analysis.whatif import whatif
from otel_train.cli import app
from otel_train.phases import BACKWARD, DATA_FETCH, STEP

pytest.importorskip("duckdb")

SLOW_RANK = 2


def _slow(rank: int, step: int) -> dict[str, float]:
    t = comm_base(rank, step)
    if rank == SLOW_RANK:
        t[DATA_FETCH] += 25.0
    return t


@pytest.fixture(scope="module")
def straggler(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks on two hosts, rank 2 slow in data_fetch, with all-reduces (comm view) and scalars."""
    run = tmp_path_factory.mktemp("q") / "straggler"
    procs = [Proc(rank=r, world_size=4, host=f"node{r // 2}") for r in range(4)]
    declare(procs)
    dp_steps(procs, range(12), _slow)
    for p in procs:
        p.scalar({"loss": 1.0 + p.rank})
        p.shutdown()
    write_run(run, procs)
    return run


def ask(run: Path, sql: str, **kw: Any) -> list[dict[str, Any]]:
    con = open_views(run, warn=lambda _: None, sql=sql, **kw)
    try:
        res = run_sql(con, sql, timeout_s=30)
    finally:
        con.close()
    return [dict(zip(res.columns, row)) for row in res.rows]


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_processes_findings_and_clock_are_summarize_s(straggler: Path) -> None:
    """Every column of these views is the summarize --json field of the same name, row for row."""
    summary = summarize(straggler, warn=lambda _: None)
    procs = ask(straggler, "SELECT * FROM processes ORDER BY rank, attempt")
    assert len(procs) == len(summary["processes"]) == 4
    for view, want in zip(procs, summary["processes"]):
        assert view == {k: want[k] for k in view}, (view, want)
    found = ask(straggler, "SELECT * FROM findings")
    assert len(found) == len(summary["findings"])
    for view, want in zip(found, summary["findings"]):
        for k in ("kind", "rank", "attempt", "step", "phase", "message"):
            assert view[k] == want.get(k), (k, view, want)
        assert json.loads(view["detail"]) == json.loads(json.dumps(want)), view
        assert (json.loads(view["comm"]) if view["comm"] else None) == want.get("comm"), view
    assert any(f["kind"] == "straggler" and f["rank"] == SLOW_RANK for f in found), found
    clock = ask(straggler, "SELECT * FROM clock ORDER BY host")
    assert clock and clock == sorted(summary["clock"], key=lambda c: c["host"])


def test_spans_and_steps_agree_with_summarize_phases(straggler: Path) -> None:
    summary = summarize(straggler, warn=lambda _: None)
    rows = ask(straggler, "SELECT name, count(*) AS n, max(dur_ms) AS mx, quantile_disc(dur_ms, 0.5) AS p50 "
                          "FROM spans GROUP BY name")
    by = {r["name"]: r for r in rows}
    for ph in summary["phases"]:
        assert by[ph["name"]]["n"] == ph["count"], ph
        assert math.isclose(by[ph["name"]]["mx"], ph["max_ms"], abs_tol=0.01), (ph, by[ph["name"]])
    steps = ask(straggler, "SELECT rank, step, dur_ms, phases_ms FROM steps ORDER BY rank, step")
    assert len(steps) == 4 * 12 and {s["rank"] for s in steps} == {0, 1, 2, 3}
    slow = [s["phases_ms"][DATA_FETCH] for s in steps if s["rank"] == SLOW_RANK]
    fast = [s["phases_ms"][DATA_FETCH] for s in steps if s["rank"] != SLOW_RANK]
    assert min(slow) > max(fast) + 20.0, (slow, fast)
    parents = ask(straggler, "SELECT DISTINCT name, parent FROM spans WHERE name IN ('backward', 'comm.all_reduce')")
    assert {(r["name"], r["parent"]) for r in parents} == {(BACKWARD, STEP), ("comm.all_reduce", BACKWARD)}


def test_comm_view_names_the_last_arrival_whatif_blames(straggler: Path) -> None:
    rows = ask(straggler, "SELECT rank, count(*) FILTER (WHERE last_arrival) AS last, sum(wait_ms) AS waited "
                          "FROM comm GROUP BY rank ORDER BY rank")
    assert max(rows, key=lambda r: r["last"])["rank"] == SLOW_RANK, rows
    assert min(rows, key=lambda r: r["waited"])["rank"] == SLOW_RANK, rows
    one = ask(straggler, "SELECT rank, arrive_ts, end_ts, wait_ms, transfer_ms FROM comm WHERE seq = 3 ORDER BY rank")
    last = max(r["arrive_ts"] for r in one)
    for r in one:
        assert math.isclose(r["wait_ms"], (last - r["arrive_ts"]) * 1e3, abs_tol=1e-6)
        assert math.isclose(r["transfer_ms"], (r["end_ts"] - last) * 1e3, abs_tol=1e-6)
    answer = whatif(load_run(straggler, warn=lambda _: None))
    worst = max(answer["by_rank"], key=lambda r: r["slowdown"])
    assert worst["rank"] == SLOW_RANK, answer["by_rank"]
    mean = ask(straggler, "SELECT avg(dur_ms) AS ms FROM steps")[0]["ms"]
    assert math.isclose(mean, answer["step_ms"]["actual"], rel_tol=0.05), (mean, answer["step_ms"])


def test_scalars_instants_and_attrs(straggler: Path) -> None:
    rows = ask(straggler, "SELECT rank, key, value FROM scalars ORDER BY rank")
    assert [(r["rank"], r["key"], r["value"]) for r in rows] == [(r, "loss", 1.0 + r) for r in range(4)]
    groups = ask(straggler, "SELECT rank, attrs->>'desc' AS d FROM instants WHERE name = 'comm.group' ORDER BY rank")
    assert [g["d"] for g in groups] == ["default_pg"] * 4
    attrs = ask(straggler, "SELECT DISTINCT attrs->>'comm.group' AS g FROM spans WHERE name = 'comm.all_reduce'")
    assert attrs == [{"g": "0"}]


def test_microbatch_column_takes_only_integers(tmp_path: Path) -> None:
    p = Proc(rank=0, world_size=1)
    p.set_step(0)
    for mb in (0, 1, "two", True, None):
        p.start("forward", **({} if mb is None else {"microbatch": mb}))
        p.advance(1.0)
        p.end()
    p.shutdown()
    write_run(tmp_path, [p])
    rows = ask(tmp_path, "SELECT microbatch FROM spans WHERE name = 'forward' ORDER BY start_ts")
    assert [r["microbatch"] for r in rows] == [0, 1, None, None, None]


def test_aligned_times_move_by_the_clock_estimate(tmp_path: Path) -> None:
    """Host node1's clock runs 40 ms ahead: its aligned times are its records' minus the estimated offset."""
    procs = [Proc(rank=r, world_size=4, host=f"node{r // 2}", t0=1_700_000_000.0 + (0.040 if r >= 2 else 0.0))
             for r in range(4)]
    declare(procs)
    dp_steps(procs, range(8))
    for p in procs:
        p.shutdown()
    run = tmp_path / "skew"
    write_run(run, procs)
    (clock,) = [c for c in ask(run, "SELECT * FROM clock") if c["host"] == "node1"]
    assert math.isclose(clock["offset_ms"], 40.0, abs_tol=1.0), clock
    rows = ask(run, "SELECT rank, (raw_start_ts - start_ts) * 1e3 AS moved FROM spans WHERE step = 4")
    for r in rows:
        assert math.isclose(r["moved"], 40.0 if r["rank"] >= 2 else 0.0, abs_tol=1.0), r


def test_formats_output_and_schema(straggler: Path, tmp_path: Path) -> None:
    sql = "SELECT rank, count(*) AS n FROM spans WHERE name = 'step' GROUP BY rank ORDER BY rank"
    out = cli("query", str(straggler), sql, "--format", "json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == [{"rank": r, "n": 12} for r in range(4)]
    out = cli("query", str(straggler), sql, "--format", "csv")
    assert out.stdout.splitlines() == ["rank,n", "0,12", "1,12", "2,12", "3,12"]
    target = tmp_path / "a.parquet"
    out = cli("query", str(straggler), sql, "--format", "parquet", "--output", str(target))
    assert out.exit_code == 0, out.output
    import duckdb

    assert duckdb.connect().execute(f"SELECT * FROM '{target}' ORDER BY rank").fetchall() == [(r, 12) for r in range(4)]
    out = cli("query", str(straggler), "--schema")
    assert out.exit_code == 0
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"spans", "comm", "steps", "processes", "scalars", "instants", "findings", "clock"}
    for col in ("rank", "attempt", "host", "source", "step", "name", "parent", "start_ts", "end_ts", "raw_start_ts",
                "dur_ms", "status", "incomplete", "microbatch", "span_id", "parent_span_id", "attrs"):
        assert f"{col} " in lines["spans"], col
    for col in ("group", "desc", "seq", "op", "peer", "bytes", "dtype", "arrive_ts", "wait_ms", "transfer_ms",
                "last_arrival"):
        assert f"{col} " in lines["comm"], col
    out = cli("query", str(straggler), sql, "--format", "parquet")
    assert out.exit_code == 2 and "--output" in out.output
    out = cli("query", str(straggler), sql, "--format", "csv", "--output", str(tmp_path / "a.csv"))
    assert out.exit_code == 0 and (tmp_path / "a.csv").read_text().splitlines()[1] == "0,12"
    (tmp_path / "link.csv").symlink_to(tmp_path / "elsewhere.csv")
    for bad in (tmp_path, tmp_path / "link.csv"):  # a folder, a symbolic link: refused before any work
        out = cli("query", str(straggler), sql, "--format", "csv", "--output", str(bad))
        assert out.exit_code == 2 and "regular file" in out.stderr, out.output
    assert not (tmp_path / "elsewhere.csv").exists()


def test_steps_window(straggler: Path) -> None:
    rows = ask(straggler, "SELECT DISTINCT step FROM spans WHERE step IS NOT NULL ORDER BY step", steps=(3, 5))
    assert [r["step"] for r in rows] == [3, 4, 5]
    out = cli("query", str(straggler), "SELECT 1", "--steps", "5-3")
    assert out.exit_code == 2 and "--steps" in out.output


def test_live_run_answers_from_disk_then_sees_more(tmp_path: Path) -> None:
    """A run still being written: rank 1 is inside backward (no end yet); once its files grow, the next
    query answers from the new bytes."""
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    simulate(procs[:1], 3, base)
    p1 = procs[1]
    for s in range(2):
        p1.set_step(s)
        p1.start(STEP)
        p1.start(BACKWARD)
        p1.advance(10.0)
        if s == 0:
            p1.end()
            p1.end()
    write_run(tmp_path, procs)
    rows = ask(tmp_path, "SELECT name, status, incomplete, end_ts FROM spans WHERE rank = 1 AND step = 1 ORDER BY name")
    assert [(r["name"], r["status"], r["incomplete"], r["end_ts"]) for r in rows] == [
        (BACKWARD, "open", True, None), (STEP, "open", True, None)]
    p1.end()
    p1.end()
    p1.shutdown()
    write_run(tmp_path, procs)
    rows = ask(tmp_path, "SELECT count(*) FILTER (WHERE incomplete) AS open, count(*) AS n FROM spans WHERE rank = 1")
    assert rows == [{"open": 0, "n": 4}]


def test_second_query_is_served_without_reading(straggler: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ask(straggler, "SELECT 1")
    import otel_train.analysis.query as q

    def boom(*_: Any) -> None:
        raise AssertionError("read again")

    monkeypatch.setattr(q, "compute_tables", boom)
    assert ask(straggler, "SELECT count(*) AS n FROM processes") == [{"n": 4}]
    with pytest.raises(AssertionError):
        ask(straggler, "SELECT 1", cache=False)


HOSTILE = [
    ("DROP TABLE spans", "DROP"),
    ("INSERT INTO findings VALUES ('x')", "INSERT"),
    ("CREATE TABLE x AS SELECT 1", "CREATE"),
    ("UPDATE spans SET name = 'x'", "UPDATE"),
    ("COPY spans TO '{out}'", "COPY"),
    ("SELECT * FROM read_csv('/etc/passwd')", "refused"),
    ("SELECT * FROM read_text('/etc/passwd')", "refused"),
    ("SELECT * FROM glob('/*')", "refused"),
    ("ATTACH '{out}' AS other", "ATTACH"),
    ("SET enable_external_access = true", "SET"),
    ("SELECT 1; DROP TABLE spans", "one statement"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("SELECT * FROM query('DROP TABLE spans')", "SELECT"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("EXPORT DATABASE '{out}'", "EXPORT"),
    ("CALL pragma_version()", "CALL"),
    ("SELEC nothing", "does not parse"),
]


@pytest.mark.parametrize(("sql", "said"), HOSTILE, ids=[h[0][:24] for h in HOSTILE])
def test_hostile_sql_is_refused_in_one_line(straggler: Path, tmp_path: Path, sql: str, said: str) -> None:
    out_file = tmp_path / "out.db"
    out = cli("query", str(straggler), sql.format(out=out_file))
    assert out.exit_code == 2, out.output
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1 and said in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not out_file.exists()
    assert cli("query", str(straggler), "SELECT count(*) FROM spans", "-f", "csv").stdout.splitlines()[1] == "288"


def test_cross_join_stops_at_the_time_cap(straggler: Path) -> None:
    """A statement that would run for many minutes is interrupted at the cap (here 1 s): one line, exit 2."""
    sql = "SELECT count(*) FROM range(1000000000) a, range(1000000000) b WHERE a.range + b.range = -1"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "otel_train.cli", "query", str(straggler), sql, "--timeout", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "time cap" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert time.monotonic() - t0 < 100
    con = open_views(straggler, warn=lambda _: None)
    with pytest.raises(QueryRefused, match="time cap"):
        run_sql(con, sql, timeout_s=0.5)
    assert run_sql(con, "SELECT 42", timeout_s=5).rows == [(42,)]  # the connection is still usable


def test_row_cap_says_it_truncated(straggler: Path) -> None:
    con = open_views(straggler, warn=lambda _: None)
    res = run_sql(con, "SELECT * FROM spans", max_rows=5)
    assert len(res.rows) == 5 and res.truncated
    assert not run_sql(con, "SELECT * FROM clock", max_rows=5).truncated


def test_trace_text_is_escaped_in_the_table(tmp_path: Path) -> None:
    p = Proc(rank=0, world_size=1)
    p.set_step(0)
    p.start("evil\x1b]52;c;aGk=\x07name")
    p.advance(1.0)
    p.end()
    p.shutdown()
    write_run(tmp_path, [p])
    out = cli("query", str(tmp_path), "SELECT name FROM spans WHERE name LIKE 'evil%'")
    assert out.exit_code == 0 and "\x1b" not in out.stdout and "\\x1b" in out.stdout, out.stdout


def test_no_traces_is_exit_2(tmp_path: Path) -> None:
    out = cli("query", str(tmp_path), "SELECT 1")
    assert out.exit_code == 2 and "Traceback" not in out.output


def test_a_statement_on_model_views_reads_no_span(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """findings, processes, comm and clock come from the compact run: no full read of every span for them."""
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    simulate(procs, 3, base)
    write_run(tmp_path, procs)
    import otel_train.analysis.query.load as load

    def boom(*_: Any, **__: Any) -> None:
        raise AssertionError("every span read")

    with monkeypatch.context() as m:
        m.setattr(load, "load_for_views", boom)
        assert ask(tmp_path, "SELECT count(*) AS n FROM processes") == [{"n": 2}]
        with pytest.raises(AssertionError, match="every span"):
            ask(tmp_path, "SELECT count(*) AS n FROM spans")
    assert ask(tmp_path, "SELECT count(*) AS n FROM spans") == [{"n": 2 * 3 * 5}]


def test_listing_the_views_sees_every_group(straggler: Path) -> None:
    names = {r["name"] for r in ask(straggler, "SHOW ALL TABLES")}
    assert {"spans", "comm", "steps", "processes", "scalars", "instants", "findings", "clock"} <= names, names


def test_a_damaged_views_database_in_the_cache_is_built_again(straggler: Path) -> None:
    from otel_train.analysis.reading.cache import cache_dir_of

    sql = "SELECT count(*) AS n FROM processes"
    assert ask(straggler, sql) == [{"n": 4}]
    folder = cache_dir_of(straggler / "structured_logs")
    dbs = list(folder.glob("*.duckdb"))  # type: ignore[union-attr]
    assert dbs
    for db in dbs:
        db.write_bytes(db.read_bytes()[:4096] + b"garbage")
    assert ask(straggler, sql) == [{"n": 4}]
    out = cli("query", str(straggler), "SELECT count(*) FROM spans", "-f", "csv")
    assert out.exit_code == 0 and out.stdout.splitlines()[1] == "288", out.output
