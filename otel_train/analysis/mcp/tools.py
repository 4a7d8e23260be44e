"""The MCP tools' answers as plain dicts (docs/mcp.md, "Tools"): every one calls the analysis the CLI
calls (load_run, summarize_run, whatif, diff_runs, the query views, export), bounds what it returns
(lists cut at a cap, the cut said in ``truncated``) and says what to ask next (``next``).

Progressive disclosure: ``list_runs`` → ``run_overview`` → ``findings`` → ``collective`` or
``span_details`` → ``query`` (the raw rows).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from otel_train.analysis.mcp.roots import Roots

MAX_ROWS = 200
"""The most rows ``query`` returns whatever is asked (default :data:`DEFAULT_ROWS`)."""
DEFAULT_ROWS = 50
LIST_CAP = 50
"""Lists inside other answers (processes, findings, per-step values) are cut here."""
QUERY_TIMEOUT_S = 20.0
"""A ``query`` statement still running after this is stopped."""
LIVE_WITHIN_S = 60.0
"""A run whose files changed within this many seconds is listed as ``live``."""


def hint(tool: str, why: str, **args: Any) -> dict[str, Any]:
    """One ``next`` entry: the tool to call, its arguments, and why."""
    return {"tool": tool, "args": args, "why": why}


def capped(items: list[Any], what: str, truncated: list[str], cap: int = LIST_CAP) -> list[Any]:
    """``items`` cut at ``cap``, the cut noted in ``truncated``."""
    if len(items) > cap:
        truncated.append(f"{what}: {cap} of {len(items)} shown")
        return items[:cap]
    return items


def _quiet(_: str) -> None:
    pass


def _window(steps: str | None) -> tuple[int, int] | None:
    if steps is None or not str(steps).strip():
        return None
    lo, sep, hi = str(steps).strip().partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"steps {steps!r}: expected A-B, like 100-200") from None
    if a < 0 or b < a:
        raise ValueError(f"steps {steps!r}: expected 0 <= A <= B")
    return a, b


def _summary(roots: Roots, run_dir: Path) -> dict[str, Any]:
    """``summarize --json`` of the run, Flight Recorder dumps read only from inside the roots."""
    from otel_train.analysis.query import dumps_dir
    from otel_train.analysis.spans import load_run
    from otel_train.analysis.summary import summarize_run, with_dumps

    run = load_run(run_dir, warn=_quiet)
    return summarize_run(with_dumps(run, dumps_dir(run_dir, run, roots.inside), _quiet))


def list_runs(roots: Roots) -> dict[str, Any]:
    now = time.time()
    runs = []
    for root, run in roots.runs():
        logs = run / "structured_logs"
        files = [e for e in os.scandir(logs) if ".jsonl" in e.name and e.is_file(follow_symlinks=False)]
        newest = max((e.stat().st_mtime for e in files), default=0.0)
        runs.append({"run": str(run), "under_root": str(root), "files": len(files),
                     "mb": round(sum(e.stat().st_size for e in files) / 2**20, 3),
                     "last_write_ts": newest, "live": now - newest < LIVE_WITHIN_S})
    nxt = [hint("run_overview", "processes, steps, hosts and findings of a run", run=runs[0]["run"])] if runs else []
    return {"roots": [str(r) for r in roots.roots], "runs": runs, "next": nxt}


def run_overview(roots: Roots, run: str) -> dict[str, Any]:
    run_dir = roots.run(run)
    summary = _summary(roots, run_dir)
    truncated: list[str] = []
    procs = summary["processes"]
    kinds: dict[str, int] = {}
    for f in summary["findings"]:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    steps = [p["final_step"] for p in procs if p["final_step"] is not None]
    out = {
        "run": str(run_dir),
        "processes": capped([{k: p[k] for k in ("rank", "attempt", "host", "pid", "final_step", "last_event",
                                                "open_spans", "ended_cleanly")} for p in procs],
                            "processes", truncated),
        "ranks": len({p["rank"] for p in procs}), "attempts": sorted({p["attempt"] for p in procs}),
        "hosts": sorted({p["host"] for p in procs if p["host"] is not None}),
        "steps": {"min_final": min(steps, default=None), "max_final": max(steps, default=None)},
        "mesh": _mesh(run_dir), "findings": kinds, "goodput": summary.get("goodput"),
        "phases": capped([{k: ph[k] for k in ("name", "count", "p50_ms", "p95_ms", "max_ms")}
                          for ph in summary["phases"] or []], "phases", truncated),
        "truncated": truncated,
    }
    out["next"] = ([hint("findings", "what went wrong and who is to blame", run=str(run_dir))] if kinds else
                   [hint("whatif", "no findings: where the step time goes", run=str(run_dir))])
    out["next"].append(hint("query", "anything else, in SQL over the views", run=str(run_dir),
                            sql="SELECT name, count(*), median(dur_ms) FROM spans GROUP BY name"))
    return out


def _mesh(run_dir: Path) -> dict[str, Any]:
    from otel_train.analysis.spans import load_run

    dims: dict[str, int] = {}
    for graph in load_run(run_dir, warn=_quiet).comm.values():
        for coords in graph.mesh.values():
            dims.update({d: size for d, (size, _) in coords.items()})
    return dims


def findings(roots: Roots, run: str, kind: str | None = None, limit: int = 20) -> dict[str, Any]:
    run_dir = roots.run(run)
    found = [f for f in _summary(roots, run_dir)["findings"] if kind is None or f["kind"] == kind]
    truncated: list[str] = []
    rows = []
    for f in capped(found, "findings", truncated, max(1, min(limit, LIST_CAP))):
        row = dict(f)
        if row.get("stacks"):
            row["stacks"] = [{**s, "frames": s.get("frames", [])[-12:]} for s in row["stacks"][:2]]
        rows.append(row)
    nxt = []
    for f in rows[:3]:
        comm = f.get("comm")
        if comm and comm.get("seq") is not None:
            nxt.append(hint("collective", f"who arrived when at the {f['kind']}'s op", run=str(run_dir),
                            group=str(comm["group"]), seq=int(comm["seq"]), attempt=f.get("attempt")))
        nxt.append(hint("explain", f"how a {f['kind']} is decided", kind=f["kind"]))
    if not rows:
        nxt.append(hint("whatif", "no findings: where the step time goes", run=str(run_dir)))
    return {"run": str(run_dir), "findings": rows, "truncated": truncated, "next": nxt}


def live_status(roots: Roots, run: str, watchers: dict[Path, Any]) -> dict[str, Any]:
    """What ``watch`` says now: one :class:`~otel_train.analysis.live.LiveRun` per run, polled each call."""
    from otel_train.analysis.live import LiveRun

    run_dir = roots.run(run)
    live = watchers.get(run_dir)
    if live is None:
        live = watchers[run_dir] = LiveRun(run_dir, warn=_quiet, background=False)
    events = live.poll()
    truncated: list[str] = []
    active = [f for f in live.raised if not any(e["type"] == "resolved" and e["finding"] is f for e in events)]
    out = {"run": str(run_dir), "finished": live.finished(), "processes": capped(live.rows(), "processes", truncated),
           "findings": capped(active, "findings", truncated), "new_events": capped(events, "events", truncated),
           "truncated": truncated}
    culprit = next((f for f in active if f.get("rank") is not None), None)
    out["next"] = [hint("live_status", "poll again: the run is still being written", run=str(run_dir))]
    if culprit is not None and culprit.get("comm"):
        out["next"].insert(0, hint("collective", "the op the culprit never issued", run=str(run_dir),
                                   group=str(culprit["comm"]["group"]), seq=int(culprit["comm"]["seq"])))
    return out


def whatif(roots: Roots, run: str, method: str | None = None, steps: str | None = None) -> dict[str, Any]:
    from otel_train.analysis.spans import load_run
    from otel_train.analysis.whatif import whatif as whatif_run

    run_dir = roots.run(run)
    answer = whatif_run(load_run(run_dir, warn=_quiet, steps=_window(steps)), method=method)
    truncated: list[str] = []
    per_step = list(answer.get("per_step", {}).items())
    answer["per_step"] = dict(capped(per_step, "per_step", truncated))
    answer["by_rank"] = capped(sorted(answer.get("by_rank", []), key=lambda r: -(r["slowdown"] or 0)), "by_rank",
                               truncated)
    answer["truncated"] = truncated
    worst = answer["by_rank"][0]["rank"] if answer["by_rank"] else None
    answer["next"] = [hint("query", "the slowest rank's steps, phase by phase", run=str(run_dir),
                           sql=f"SELECT step, dur_ms, phases_ms FROM steps WHERE rank = {worst} ORDER BY dur_ms DESC "
                               "LIMIT 10" if worst is not None else "SELECT * FROM steps LIMIT 10")]
    return answer


def diff(roots: Roots, run_a: str, run_b: str) -> dict[str, Any]:
    from otel_train.analysis.diff import diff_runs
    from otel_train.analysis.spans import load_run

    a, b = roots.run(run_a), roots.run(run_b)
    answer = diff_runs(load_run(a, warn=_quiet), load_run(b, warn=_quiet))
    truncated: list[str] = []
    for key in ("phases", "ranks", "findings", "steps"):
        if isinstance(answer.get(key), list):
            answer[key] = capped(answer[key], key, truncated)
    answer["truncated"] = truncated
    answer["next"] = [hint("run_overview", "the candidate run's own findings", run=str(b))]
    return answer
