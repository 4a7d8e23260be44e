"""The MCP server: the tools of :mod:`.tools` and :mod:`.drill` on the official ``mcp`` SDK's
``MCPServer``, over stdio (docs/mcp.md).

Every tool returns JSON text: the answer, ``truncated`` (what was cut) and ``next`` (the tools to call
next, with their arguments). A failure is an answer too: ``{"error": one line, "next": [...]}``, never
a traceback. An answer longer than :data:`MAX_CHARS` has its lists cut until it fits, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from otel_train.analysis.mcp import drill, tools
from otel_train.analysis.mcp.explain import KINDS, explain
from otel_train.analysis.mcp.roots import Roots

MAX_CHARS = 60_000
"""The longest answer a tool returns (lists are cut to fit; ``truncated`` says so)."""

INSTRUCTIONS = (
    "otel-train traces of distributed PyTorch training runs: which rank, at which step, in which phase. "
    "Start with list_runs, then run_overview, then findings (the culprit of a hang, desync, crash, "
    "straggler), then collective or span_details for one op or span, and query for raw rows in SQL. "
    "live_status says what a running job is doing now. Every answer has a 'next' list of tools to call."
)


def encode(obj: Any) -> str:
    """``obj`` as JSON text, at most :data:`MAX_CHARS` long (lists cut, the cut said)."""
    text = msgspec.json.encode(obj, enc_hook=str).decode()
    cap = 20
    while len(text) > MAX_CHARS and cap >= 1:
        obj = _cut(obj, cap)
        if isinstance(obj, dict):
            obj.setdefault("truncated", [])
            if isinstance(obj["truncated"], list):
                obj["truncated"].append(f"answer over {MAX_CHARS} characters: every list cut to {cap} items")
        text = msgspec.json.encode(obj, enc_hook=str).decode()
        cap //= 2
    return text


def _cut(obj: Any, cap: int) -> Any:
    if isinstance(obj, dict):
        return {k: _cut(v, cap) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cut(v, cap) for v in obj[:cap]]
    if isinstance(obj, str) and len(obj) > 2000:
        return obj[:2000] + f"… ({len(obj)} characters)"
    return obj


def answer(fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> str:
    """Run a tool; its dict as JSON text, or a one-line error with what to do next."""
    from otel_train.analysis.query import QueryRefused
    from otel_train.analysis.records import TraceReadError

    try:
        return encode(fn(*args, **kwargs))
    except (QueryRefused, TraceReadError, ValueError, FileNotFoundError, PermissionError) as exc:
        said = " ".join(str(exc).split())
    except Exception as exc:  # noqa: BLE001 - an agent gets one line, never a traceback
        said = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return encode({"error": said[:1000], "next": [tools.hint("list_runs", "the runs this server can read")]})


def build(roots: Sequence[str | Path]) -> Any:
    """The server for ``roots`` (run directories or folders holding them), its tools registered."""
    from mcp.server.mcpserver import MCPServer

    where = Roots(roots)
    server = MCPServer("otel-train", instructions=INSTRUCTIONS)
    _run_tools(server.tool, where, {})
    _drill_tools(server.tool, where)
    return server


def _run_tools(tool: Callable[..., Any], where: Roots, watchers: dict[Path, Any]) -> None:
    """The tools about whole runs: list_runs, run_overview, findings, live_status, whatif, diff."""

    @tool(description="The runs under this server's roots: path, size, last write, whether it is live. Start here.")
    def list_runs() -> str:
        return answer(tools.list_runs, where)

    @tool(description="One run at a glance: processes (rank, attempt, host, final step, open spans), steps, "
                      "attempts, mesh, hosts, phase timings, goodput and how many findings of each kind.")
    def run_overview(run: str) -> str:
        return answer(tools.run_overview, where, run)

    @tool(description="The findings summarize decides (hang, desync, crash, error, straggler, restart, clock_skew), "
                      "culprits only, with evidence: the op (comm: group, seq, waiting, missing), victims, stacks.")
    def findings(run: str, kind: str | None = None, limit: int = 20) -> str:
        return answer(tools.findings, where, run, kind, limit)

    @tool(description="What `otel-train watch` says now about a run still being written: each process's step, "
                      "open spans and state, and the live findings (a hang while the job still runs). Poll it.")
    def live_status(run: str) -> str:
        return answer(tools.live_status, where, run, watchers)

    @tool(description="How much faster each step would be without each rank's and each phase's slowness "
                      "(whatif --json): slowdown by rank, phase, mesh dim; method peers or typical; steps A-B.")
    def whatif(run: str, method: str | None = None, steps: str | None = None) -> str:
        return answer(tools.whatif, where, run, method, steps)

    @tool(description="Run B against run A per phase and per rank: regressions and improvements (diff --json).")
    def diff(run_a: str, run_b: str) -> str:
        return answer(tools.diff, where, run_a, run_b)


def _drill_tools(tool: Callable[..., Any], where: Roots) -> None:
    """The tools that go down to rows, spans and ops, and the explanations: query, span_details,
    collective, export, explain."""

    @tool(description="One read-only SQL SELECT (DuckDB) over the run's views: spans, comm, steps, processes, "
                      "scalars, instants, findings, clock (DESCRIBE a view for its columns). Rows capped "
                      f"(max_rows, at most {tools.MAX_ROWS}), {tools.QUERY_TIMEOUT_S:g} s time cap; steps A-B.")
    def query(run: str, sql: str, max_rows: int = tools.DEFAULT_ROWS, steps: str | None = None) -> str:
        return answer(drill.query, where, run, sql, max_rows, steps)

    @tool(description="One span in full: its row, its parent, its children by name, its instants (stall "
                      "records with stacks) and its comm op. rank narrows a span id seen on several ranks.")
    def span_details(run: str, span_id: str, rank: int | None = None) -> str:
        return answer(drill.span_details, where, run, span_id, rank)

    @tool(description="One collective (group, seq) across its group: each member's arrival and end on the aligned "
                      "clock, its wait for the last member, who never issued it, who waited for whom.")
    def collective(run: str, group: str, seq: int, attempt: int | None = None) -> str:
        return answer(drill.collective, where, run, group, seq, attempt)

    @tool(description="Write the run as a Perfetto (or chrome) trace under the run's analysis/ folder; returns "
                      "its path (open it in ui.perfetto.dev).")
    def export(run: str, format: str = "perfetto", steps: str | None = None) -> str:  # noqa: A002
        return answer(drill.export, where, run, format, steps)

    @tool(name="explain", description="What a finding kind means, how it is decided and what evidence it "
                                      "carries. Kinds: " + ", ".join(KINDS) + ".")
    def explain_kind(kind: str) -> str:
        return answer(explain, kind)


def serve(roots: Sequence[str | Path]) -> None:
    """Serve the tools on stdio until the client closes it."""
    build(roots).run("stdio")
