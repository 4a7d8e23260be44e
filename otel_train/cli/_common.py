"""Plumbing every command shares: errors as one line, warnings and progress on stderr, JSON on stdout.

Exit codes: 0 ok; 2 the path holds no trace files (or is not a directory); 1 anything else (a
one-line ``error:`` message, never a traceback).

Start-up: every command module imports this one when ``otel-train`` starts, so it imports neither the
analysis, nor msgspec, nor rich at module level; each function imports what it uses when it runs
(docs/benchmarks.md, "Start-up"; tests/test_cli_imports.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from otel_train.cli._text import clean, json_safe, printable

if TYPE_CHECKING:
    from rich.console import Console

    from otel_train.analysis.spans import Run

EXIT_NO_TRACES = 2
EXIT_FAILURE = 1

_TERMINAL_ENV = ("FORCE_TERMINAL", "TTY_COMPATIBLE", "FORCE_COLOR")
"""Variables with which rich may call a stream a terminal when ``isatty()`` says it is not."""


@cache
def err_console() -> Console:
    """Where warnings, errors and the progress bar go (stdout stays clean for --json and pipes); made on
    first use, so a command that warns about nothing never imports rich for it."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


def stderr_is_terminal() -> bool:
    """Whether the progress bar would draw: rich's own answer, asked only when stderr could be a terminal."""
    try:
        maybe = sys.stderr.isatty() or any(v in os.environ for v in _TERMINAL_ENV)
    except (AttributeError, ValueError):  # no stderr, or a closed one
        maybe = any(v in os.environ for v in _TERMINAL_ENV)
    return maybe and err_console().is_terminal


RUN_ID_HELP = "Analyse the run with this id (default: the one started last, when the directory holds several)."


def select_run(run_id: str | None) -> None:
    """``--run-id``: the run every read of this command analyses (docs/analysis.md, "Several runs in one
    directory"); None: the run started last."""
    if run_id is None and "otel_train.analysis.spans" not in sys.modules:
        return  # no run was chosen in this process: the default holds (a remembered result imports no reader)
    from otel_train.analysis.spans import use_run

    use_run(run_id)


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``."""
    err_console().print(f"error: {printable(' '.join(message.split()))}", markup=False)
    raise typer.Exit(code)


HEARD: list[list[str]] = []
"""Where a remembered command records the warnings it says (otel_train/cli/_remember.py)."""


def warn(message: str) -> None:
    """One warning line on stderr (goes above a running progress bar)."""
    for said in HEARD:
        said.append(message)
    err_console().print(printable(message), markup=False)


@contextmanager
def cli_errors() -> Iterator[None]:
    """Run a command body: TraceReadError, a bad cache setting and an output target that is not a regular
    file exit 2, other failures exit 1, each with one line."""
    from otel_train.analysis.outputs import OutputError
    from otel_train.analysis.reading.cache_files import CacheSettingError
    from otel_train.analysis.records import TraceReadError  # here: --help never loads the reader

    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except TraceReadError as exc:
        fail(str(exc), EXIT_NO_TRACES)
    except (CacheSettingError, OutputError) as exc:  # a bad OTEL_TRAIN_CACHE_MB; an output that is no file
        fail(str(exc), 2)
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error worth a message.
        sys.stderr.close()
        raise typer.Exit(0) from None
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}", EXIT_FAILURE)
    except Exception as exc:  # noqa: BLE001 - the CLI promises one line, never a traceback
        fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE)


@contextmanager
def byte_progress(path: str | Path, label: str) -> Iterator[Callable[[int], None] | None]:
    """A progress callback (bytes read) drawing a bar on stderr when it is a terminal; else None.

    Raises TraceReadError first when ``path`` holds no trace files.
    """
    from otel_train.analysis.records import find_process_files

    total = sum(pf.size for pf in find_process_files(path))
    if not stderr_is_terminal():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console(), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def load(path: str | Path, label: str = "reading", *, steps: str | None = None, cache: bool = True) -> Run:
    """Digest the run at ``path`` with progress and warnings on stderr; reports skipped lines.

    ``steps`` is ``--steps A-B`` as typed (a bad one exits 2 with one line); ``cache`` False is
    ``--no-cache`` (docs/analysis.md, "Reading")."""
    from otel_train.analysis.spans import load_run

    window = parse_window(steps) if steps is not None else None
    with byte_progress(path, label) as progress:
        run = load_run(path, warn=warn, progress=progress, steps=window, cache=cache)
    note_malformed(run.malformed_lines)
    return run


def parse_window(text: str) -> tuple[int, int]:
    """``--steps 100-200`` -> (100, 200), inclusive; ``7`` -> (7, 7); anything else exits 2 with one line."""
    lo_s, sep, hi_s = text.strip().partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        fail(f"--steps {text!r}: expected a step or a range like 100-200", EXIT_NO_TRACES)
    if lo < 0 or hi < lo:
        fail(f"--steps {text!r}: a range must be low-high with 0 <= low <= high, like 100-200", EXIT_NO_TRACES)
    return lo, hi


def note_malformed(count: int) -> None:
    """Say how many bad lines were skipped in total, if any."""
    if count:
        warn(f"warning: skipped {count} malformed line{'s' if count != 1 else ''} in total")


def print_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON on stdout (NaN and infinities become null)."""
    print_text(json_text(obj))


def json_text(obj: Any) -> str:
    """What :func:`print_json` writes (a big result's text is what a remembered result keeps)."""
    import msgspec

    try:
        raw = msgspec.json.encode(obj)
    except UnicodeEncodeError:  # a lone surrogate from a trace file: written as its escape instead
        raw = msgspec.json.encode(clean(obj, limit=None))
    return json_safe(msgspec.json.format(raw, indent=2).decode()) + "\n"


def json_part(obj: Any, level: int) -> str:
    """:func:`json_text` of ``obj`` as it reads ``level`` deep inside an indented object, without the
    final newline: a big result's text made a part at a time, the same bytes as the whole."""
    text = json_text(obj)[:-1]
    return text.replace("\n", "\n" + "  " * level) if level else text


def print_text(text: str) -> None:
    """Write ``text`` on stdout as it is."""
    sys.stdout.write(text)
    sys.stdout.flush()


def fmt_ms(value: float | None) -> str:
    """Milliseconds for tables: 3 significant places, '-' when unknown."""
    if value is None or value != value:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def comm_line(comm: dict[str, Any]) -> str:
    """A finding's ``comm`` object in one line: ``group 0 seq 5 all_reduce; waiting 0–4, 6, 7; missing 5``."""
    from otel_train.analysis.comm import rank_ranges

    parts = [f"group {comm['group']} seq {comm['seq']} {comm['op']}"]
    if comm.get("waiting"):
        parts.append(f"waiting {rank_ranges(comm['waiting'])}")
    if comm.get("missing"):
        parts.append(f"missing {rank_ranges(comm['missing'])}")
    ops = comm.get("ops") or {}
    if len(set(ops.values())) > 1:
        parts.append("ops " + ", ".join(f"{r}: {op}" for r, op in ops.items()))
    return "; ".join(parts)
