"""``otel-train watch PATH``: follow a run while it is written and name the culprit as it happens."""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from otel_train.schema import STRUCTURED_LOGS_DIR
from otel_train.cli._app import app
from otel_train.cli._text import clean, console, json_safe, printable
from otel_train.cli._common import RUN_ID_HELP, cli_errors, comm_line, fail, note_malformed, select_run, warn

if TYPE_CHECKING:  # rich, msgspec and the analysis are imported where they are used: start-up stays small
    from rich.console import Group
    from rich.text import Text

    from otel_train.analysis.live import LiveRun

EXIT_FINDING = 3
POLL_S = 0.5
HOOK_WAIT_S = 10.0
FINDING_KINDS = ("hang", "crash", "error", "straggler", "restart", "desync", "clock_skew")
"""otel_train.analysis.findings.FINDING_KINDS, for --exit-on's help, without importing the analysis at start-up
(tests/test_cli_imports.py checks that the two agree)."""


@app.command()
def watch(
    path: Path = typer.Argument(..., help="Run directory or its structured_logs/ directory (may not exist yet)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines (finding, resolved, end) instead of a table."),
    run_id: Optional[str] = typer.Option(None, "--run-id", metavar="ID", help=RUN_ID_HELP),
    exit_on: str = typer.Option("", "--exit-on", metavar="KIND,…",
                                help=f"Exit 3 right after a finding of these kinds ({', '.join(FINDING_KINDS)})."),
    timeout: float = typer.Option(0.0, "--timeout", min=0.0, help="Stop after this many seconds (exit 0); 0: never."),
    on_finding: str = typer.Option("", "--on-finding", metavar="CMD",
                                   help="Run CMD through the shell for each finding, its JSON on stdin."),
    stacks: bool = typer.Option(False, "--stacks", help="Add the culprit's Python stacks (stall records, py-spy)."),
    fr: Optional[Path] = typer.Option(
        None, "--fr",
        help="Flight Recorder dumps (a file or a directory) merged with the trace's comm ops as they appear "
             "(default <run>/flight_recorder/).",
    ),
    no_align: bool = typer.Option(
        False, "--no-align",
        help="Compare hosts on their raw clocks: nothing estimated from the collectives or file times (docs/clock.md).",
    ),
) -> None:
    """Follow a run as it is written: a live table, findings (hang, crash, error, straggler, restart) as they happen."""
    with cli_errors():
        select_run(run_id)
        from otel_train.analysis.live import LiveRun
        from otel_train.analysis.records import TraceReadError
        from otel_train.analysis.summary import FR_DIR, read_fr

        kinds = {k.strip() for k in exit_on.split(",") if k.strip()}
        unknown = sorted(kinds - set(FINDING_KINDS))
        if unknown:
            fail(f"--exit-on: unknown finding kind {', '.join(unknown)}; use any of {', '.join(FINDING_KINDS)}")
        if path.exists() and not path.is_dir():
            raise TraceReadError(f"{path}: not a directory; pass a run directory or its structured_logs/")
        fr_path = fr if fr is not None else (path.parent if path.name == STRUCTURED_LOGS_DIR else path) / FR_DIR
        live = LiveRun(path, warn=warn, stacks=stacks, fr=fr_path, read_fr=partial(read_fr, warn=warn),
                       align=not no_align)
        hooks = _Hooks(on_finding)
        view = _JsonLines() if as_json else _Table(live)
        try:
            code = _follow(live, view, hooks, kinds, time.monotonic() + timeout if timeout else None)
        finally:
            live.close()
            view.close()
            hooks.wait()
        note_malformed(live.malformed_lines)
        raise typer.Exit(code)


def _follow(live: LiveRun, view: Any, hooks: _Hooks, exit_on: set[str], deadline: float | None) -> int:
    while True:
        for event in live.poll():
            view.event(event)
            if event["type"] == "finding":
                hooks.run(event["finding"])
                if event["finding"]["kind"] in exit_on:
                    view.end(live)
                    return EXIT_FINDING
        view.refresh()
        if live.finished() or (deadline is not None and time.monotonic() >= deadline):
            view.end(live)
            return 0
        time.sleep(POLL_S)


def _end_event(live: LiveRun) -> dict[str, Any]:
    return {"type": "end", "ts": time.time(), "processes": len(live.procs), "findings": len(live.raised)}


class _JsonLines:
    """One JSON object per line on stdout, flushed at once (for pipes and scripts)."""

    def event(self, event: dict[str, Any]) -> None:
        import msgspec

        try:
            line = msgspec.json.encode(event)
        except UnicodeEncodeError:  # a lone surrogate from a trace file: written as its escape instead
            line = msgspec.json.encode(clean(event, limit=None))
        sys.stdout.write(json_safe(line.decode()) + "\n")
        sys.stdout.flush()

    def refresh(self) -> None:
        pass

    def end(self, live: LiveRun) -> None:
        self.event(_end_event(live))

    def close(self) -> None:
        pass


class _Table:
    """A rich live table, one row per process, with the findings under it."""

    def __init__(self, live: LiveRun) -> None:
        from rich.live import Live

        self.live = live
        self.console = console()
        self.lines: list[Text] = []
        self.view = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.view.start()

    def event(self, event: dict[str, Any]) -> None:
        from rich.text import Text

        from otel_train.analysis.stacks import describe_stack

        f = clean(event["finding"])
        style = "bold red" if event["type"] == "finding" and f["kind"] in ("hang", "crash", "desync") else "yellow"
        label = f["kind"] if event["type"] == "finding" else f"resolved {f['kind']}"
        self.lines.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(event['ts']))} {label}: {f['message']}",
                               style=style if event["type"] == "finding" else "green"))
        if f.get("comm") and f["kind"] != "straggler" and event["type"] == "finding":
            self.lines.append(Text(f"    {comm_line(f['comm'])}", style="dim"))
        for stack in (f.get("stacks") or [])[:1]:
            self.lines.append(Text(f"    stack of {describe_stack(stack)}", style="dim"))

    def refresh(self) -> None:
        self.view.update(self._render())

    def end(self, live: LiveRun) -> None:
        self.refresh()

    def close(self) -> None:
        self.view.stop()

    def _render(self) -> Group:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"otel-train watch {printable(str(self.live.tail.path))}", title_justify="left")
        for col in ("rank", "att", "step", "open spans", "open for", "state"):
            table.add_column(col, overflow="fold")
        styles = {"stalled": "red", "silent": "red", "dead": "bold red", "ended": "dim"}
        rows = clean(self.live.rows())
        for row in rows:
            open_for = row["open_for"]
            table.add_row(str(row["rank"]), str(row["attempt"]), "-" if row["step"] is None else str(row["step"]),
                          " > ".join(row["open"]) or "-", "-" if open_for is None else f"{open_for:.1f} s",
                          Text(row["state"], style=_state_style(row["state"], styles)))
        waiting = [] if rows else [Text("waiting for trace files ...", style="dim")]
        return Group(table, *waiting, *self.lines)


def _state_style(state: str, styles: dict[str, str]) -> str:
    if state.startswith("culprit"):
        return "bold white on red"
    if state.startswith("waiting on "):
        return "yellow"
    return styles.get(state, "green")


class _Hooks:
    """``--on-finding``: CMD through the shell per finding, its JSON on stdin; output to stderr."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.running: list[subprocess.Popen[bytes]] = []

    def run(self, finding: dict[str, Any]) -> None:
        if not self.command:
            return
        try:
            # The hook's output goes to stderr (fd 2): stdout carries --json lines.
            proc = subprocess.Popen(self.command, shell=True, stdin=subprocess.PIPE, stdout=2)
        except OSError as exc:
            warn(f"warning: --on-finding: could not run {self.command!r}: {exc.strerror or exc}")
            return
        import msgspec

        try:
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(finding))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the command does not read its stdin: its business
        self.running.append(proc)
        self.running = [p for p in self.running if self._reaped(p) is None]

    def _reaped(self, proc: subprocess.Popen[bytes]) -> int | None:
        code = proc.poll()
        if code:
            warn(f"warning: --on-finding command exited with status {code}")
        return code

    def wait(self) -> None:
        """Give hooks still running up to HOOK_WAIT_S in all to finish."""
        deadline = time.monotonic() + HOOK_WAIT_S
        for proc in self.running:
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                warn(f"warning: --on-finding command still running after {HOOK_WAIT_S:.0f} s; left running")
                continue
            if code:
                warn(f"warning: --on-finding command exited with status {code}")
