"""``otel-train mcp``: every tool through the ``mcp`` SDK's own client over stdio, against real torchrun
runs (gloo on CPU): a clean run, a straggler, a hang asked while the job still runs, and a desync.

The four jobs run two at a time once per module; one server session asks everything (the hang first,
while its job is still stuck), and the tests judge the answers: the culprit of each fault, the
evidence, the caps, the paths outside the roots, and the query views against ``summarize`` on the
same runs. Assertions are on who and what, never on how fast.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_comm_faults import DDP, blamed, launch, stop

from otel_train.analysis.summary import summarize

pytest.importorskip("mcp")
pytest.importorskip("torch.distributed")

import anyio  # noqa: E402
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

TOOLS = {"list_runs", "run_overview", "findings", "live_status", "whatif", "diff", "query", "span_details",
         "collective", "export", "explain"}
SLOW_RANK = 1
HANG_WAIT_S = 150.0
"""How long the live hang is polled for (the job's own collective timeout is longer)."""

Ask = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp")


@pytest.fixture(scope="module")
def jobs(root: Path) -> dict[str, Any]:
    """The four jobs, two at a time (the clean and straggler runs judge step times: 4 ranks on the two
    cores, most of each step off the CPU, as a step waits on a GPU); the hang's job is left running
    (stopped at the module's end)."""
    paths = {k: root / k for k in ("clean", "straggler", "desync", "hang")}
    timed = ("--steps", "20", "--eval-every", "0", "--checkpoint-every", "0", "--hidden", "64", "--gpu-wait-ms", "30",
             "--cpu-wait")
    procs = {
        "clean": launch("train_ddp.py", paths["clean"], 2, *timed),
        "straggler": launch("train_ddp.py", paths["straggler"], 2, *timed, "--slow-rank", str(SLOW_RANK),
                            "--slow-ms", "40"),
    }
    try:
        for k in ("clean", "straggler"):
            assert procs[k].wait(240) == 0, (paths[k].parent / f"{k}.log").read_text()[-3000:]
        procs["desync"] = launch("train_ddp.py", paths["desync"], 3, *DDP, "--fault", "desync-op", "--fault-rank", "2",
                                 "--fault-step", "3", "--timeout-s", "8")
        procs["hang"] = launch("train_ddp.py", paths["hang"], 2, *DDP, "--fault", "skip-collective", "--fault-rank",
                               "1", "--fault-step", "4", "--timeout-s", "300")
        stop(procs["desync"], paths["desync"], wait_s=120)
        yield {"paths": paths, "procs": procs}
    finally:
        for k, proc in procs.items():
            stop(proc, paths[k])


async def _session(root: Path, script: Callable[[Ask], Awaitable[None]]) -> list[str]:
    server = StdioServerParameters(command=sys.executable, args=["-m", "otel_train.cli", "mcp", str(root)],
                                   env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        names = [t.name for t in (await session.list_tools()).tools]

        async def ask(tool: str, args: dict[str, Any]) -> dict[str, Any]:
            res = await session.call_tool(tool, args)
            (content,) = res.content
            return json.loads(content.text)  # type: ignore[union-attr]

        await script(ask)
    return names


async def _live_hang(ask: Ask, hang: str, out: dict[str, Any]) -> None:
    """While the job is stuck: live_status until it names the hang, then the op and the open spans."""
    deadline = time.monotonic() + HANG_WAIT_S
    while time.monotonic() < deadline:
        live = await ask("live_status", {"run": hang})
        if any(f["kind"] == "hang" for f in live.get("findings", [])):
            break
        await anyio.sleep(1.0)
    out["live"] = live
    (f,) = [f for f in live["findings"] if f["kind"] == "hang"]
    out["live_collective"] = await ask("collective", {"run": hang, "group": str(f["comm"]["group"]),
                                                      "seq": f["comm"]["seq"]})
    out["live_open"] = await ask("query", {"run": hang, "sql": "SELECT rank, name, status, span_id FROM spans "
                                                               "WHERE incomplete ORDER BY rank, start_ts"})
    out["live_findings"] = await ask("findings", {"run": hang})


async def _everything(ask: Ask, root: Path, out: dict[str, Any]) -> None:
    runs = {k: str(root / k) for k in ("clean", "straggler", "desync", "hang")}
    await _live_hang(ask, "hang", out)
    out["list"] = await ask("list_runs", {})
    for k, run in runs.items():
        out[f"overview_{k}"] = await ask("run_overview", {"run": run})
        out[f"findings_{k}"] = await ask("findings", {"run": run})
    (d,) = [f for f in out["findings_desync"]["findings"] if f["kind"] == "desync"]
    out["desync_op"] = await ask("collective", {"run": runs["desync"], "group": str(d["comm"]["group"]),
                                                "seq": d["comm"]["seq"]})
    out["whatif"] = await ask("whatif", {"run": runs["straggler"]})
    out["arrivals"] = await ask("query", {"run": runs["straggler"], "sql": (
        "SELECT rank, count(*) FILTER (WHERE last_arrival) AS last, sum(wait_ms) AS waited FROM comm "
        "WHERE \"desc\" = 'default_pg' OR \"desc\" IS NULL GROUP BY rank ORDER BY rank")})
    out["views_processes"] = await ask("query", {"run": runs["straggler"], "sql": "SELECT * FROM processes ORDER BY rank"})
    out["views_findings"] = await ask("query", {"run": runs["desync"], "sql": "SELECT kind, rank, step, phase, message "
                                                                             "FROM findings"})
    out["capped"] = await ask("query", {"run": runs["clean"], "sql": "SELECT * FROM spans", "max_rows": 5})
    one = out["capped"]["rows"][0]
    out["span"] = await ask("span_details", {"run": runs["clean"], "span_id": one["span_id"], "rank": one["rank"]})
    out["diff"] = await ask("diff", {"run_a": runs["clean"], "run_b": runs["straggler"]})
    out["export"] = await ask("export", {"run": runs["clean"]})
    out["explain"] = await ask("explain", {"kind": "hang"})
    out["explain_bad"] = await ask("explain", {"kind": "nonsense"})
    out["hostile_sql"] = await ask("query", {"run": runs["clean"], "sql": "SELECT * FROM read_csv('/etc/passwd')"})
    out["hostile_write"] = await ask("query", {"run": runs["clean"], "sql": "COPY spans TO '/tmp/otel-mcp-x.csv'"})
    out["outside"] = await ask("run_overview", {"run": "/etc"})
    out["dotdot"] = await ask("run_overview", {"run": "../../../../etc"})
    out["escape"] = await ask("findings", {"run": "escape"})


@pytest.fixture(scope="module")
def answers(jobs: dict[str, Any], root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every tool asked once in one stdio session (the hang while its job runs)."""
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(jobs["paths"]["clean"] / "structured_logs", outside / "structured_logs")
    (root / "escape").mkdir()
    (root / "escape" / "structured_logs").symlink_to(outside / "structured_logs")
    out: dict[str, Any] = {}
    out["tools"] = anyio.run(_session, root, lambda ask: _everything(ask, root, out))
    assert jobs["procs"]["hang"].poll() is None or out["live"], "the hang's job ended before it was asked"
    return out


def test_the_tools_are_the_contract_s(answers: dict[str, Any]) -> None:
    assert set(answers["tools"]) == TOOLS


def test_every_answer_says_what_to_call_next(answers: dict[str, Any]) -> None:
    for key, ans in answers.items():
        if isinstance(ans, dict) and True:
            assert ans.get("next"), (key, ans)
            assert all(n["tool"] in TOOLS for n in ans["next"]), (key, ans["next"])


def culprits(found: list[dict[str, Any]], save: Path) -> set[int]:
    """The ranks named by hang, desync or straggler findings, stragglers the machine made (the kernel's
    word: tests/contention.py) left out."""
    return blamed({"findings": found}, save)


def test_live_hang_names_the_rank_that_skipped_the_collective(answers: dict[str, Any], jobs: dict[str, Any]) -> None:
    (hang,) = [f for f in answers["live"]["findings"] if f["kind"] == "hang"]
    assert hang["rank"] == 1 and hang["comm"]["missing"] == [1] and hang["comm"]["waiting"] == [0], hang
    assert culprits(answers["live"]["findings"], jobs["paths"]["hang"]) == {1}, answers["live"]["findings"]
    op = answers["live_collective"]
    assert op["missing"] == [1] and op["waiting"] == [0] and "never issued" in op["who_waited_for_whom"], op
    opened = answers["live_open"]["rows"]
    assert {r["rank"] for r in opened} == {0, 1} and {r["status"] for r in opened} == {"open"}, opened
    assert any(r["name"] == "comm.all_reduce" for r in opened if r["rank"] == 0), opened
    (after,) = [f for f in answers["live_findings"]["findings"] if f["kind"] == "hang"]
    assert after["rank"] == 1, after


def test_desync_names_the_minority_rank_and_each_side(answers: dict[str, Any], jobs: dict[str, Any]) -> None:
    (d,) = [f for f in answers["findings_desync"]["findings"] if f["kind"] == "desync"]
    assert d["rank"] == 2, d
    assert culprits(answers["findings_desync"]["findings"], jobs["paths"]["desync"]) == {2}
    op = answers["desync_op"]
    ops = {a["rank"]: a["op"] for a in op["arrivals"]}
    assert ops[2] == "broadcast" and ops[0] == ops[1] == "all_reduce", op
    assert any(n["tool"] == "collective" for n in answers["findings_desync"]["next"])


def test_straggler_is_named_and_whatif_blames_it(answers: dict[str, Any], jobs: dict[str, Any]) -> None:
    found = answers["findings_straggler"]["findings"]
    assert SLOW_RANK in [f["rank"] for f in found if f["kind"] == "straggler"], found
    assert culprits(found, jobs["paths"]["straggler"]) == {SLOW_RANK}, found
    assert answers["whatif"]["by_rank"][0]["rank"] == SLOW_RANK, answers["whatif"]["by_rank"]
    rows = answers["arrivals"]["rows"]
    assert max(rows, key=lambda r: r["last"])["rank"] == SLOW_RANK, rows


def test_clean_run_has_no_culprit(answers: dict[str, Any], jobs: dict[str, Any]) -> None:
    found = answers["findings_clean"]["findings"]
    assert [f for f in found if f["kind"] in ("hang", "crash", "desync", "error")] == [], found
    assert culprits(found, jobs["paths"]["clean"]) == set(), found
    over = answers["overview_clean"]
    assert over["ranks"] == 2 and all(p["ended_cleanly"] for p in over["processes"]), over
    assert answers["span"]["span"]["span_id"] == answers["capped"]["rows"][0]["span_id"]


def test_query_views_match_summarize_on_the_same_runs(answers: dict[str, Any], jobs: dict[str, Any]) -> None:
    paths = jobs["paths"]
    summary = summarize(paths["straggler"], warn=lambda _: None)
    keys = ("rank", "attempt", "final_step", "last_event", "records")
    assert [{k: p[k] for k in keys} for p in answers["views_processes"]["rows"]] == [
        {k: p[k] for k in keys} for p in summary["processes"]]
    desync = summarize(paths["desync"], warn=lambda _: None)
    assert answers["views_findings"]["rows"] == [
        {k: f[k] for k in ("kind", "rank", "step", "phase", "message")} for f in desync["findings"]]


def test_caps_and_truncation_are_said(answers: dict[str, Any]) -> None:
    capped = answers["capped"]
    assert capped["row_count"] == 5 and capped["truncated"] is True and "5 rows" in capped["note"], capped


def test_list_diff_export_explain(answers: dict[str, Any], root: Path) -> None:
    listed = {Path(r["run"]).name for r in answers["list"]["runs"]}
    assert {"clean", "straggler", "desync", "hang"} <= listed and "escape" not in listed, listed
    assert answers["diff"]["phases"] and "findings" in answers["diff"]
    path = Path(answers["export"]["path"])
    assert path.parent == (root / "clean" / "analysis").resolve() and path.stat().st_size > 0
    assert "culprit" in answers["explain"]["means"] and answers["explain"]["docs"].startswith("docs/")
    assert "hang" in answers["explain_bad"]["kinds"]


def test_nothing_outside_the_roots(answers: dict[str, Any]) -> None:
    for key in ("outside", "dotdot", "escape"):
        assert "outside the roots" in answers[key]["error"], (key, answers[key])
    assert "refused" in answers["hostile_sql"]["error"]
    assert "COPY" in answers["hostile_write"]["error"] and not Path("/tmp/otel-mcp-x.csv").exists()


def test_flight_recorder_folder_recorded_outside_the_roots_is_not_read(tmp_path: Path) -> None:
    """A trace file can name any fr_dir in its settings: the server reads dumps only inside its roots."""
    from analysis_fixtures import Proc, write_run

    from otel_train.analysis.mcp.roots import Roots
    from otel_train.analysis.query import dumps_dir
    from otel_train.analysis.spans import load_run

    outside = tmp_path / "elsewhere"
    run = tmp_path / "root" / "run"
    p = Proc(rank=0, world_size=1)
    p.instant("process_start", settings={"fr_dir": str(outside)})
    p.shutdown()
    write_run(run, [p])
    loaded = load_run(run, warn=lambda _: None)
    roots = Roots([tmp_path / "root"])
    assert dumps_dir(run, loaded, None) == outside  # the CLI reads what the run recorded
    assert dumps_dir(run, loaded, roots.inside) == run / "flight_recorder"
