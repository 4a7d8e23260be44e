"""The folders an MCP server may read, and the runs in them (docs/mcp.md, "Safety").

Every path a tool is given is resolved (symbolic links followed, ``..`` removed) and must lie inside
one of the roots the server was started with; so must every link inside the run directory (its
``structured_logs/`` files, ``flight_recorder/``, ``analysis/``, the read cache): a run whose link
points outside the roots is refused, whatever the tool.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from otel_train import schema

MAX_DEPTH = 4
"""How deep under a root :meth:`Roots.runs` looks for run directories."""
MAX_RUNS = 200
"""At most this many runs are listed."""
CHECK_DEPTH = 2
"""How deep inside a run directory links are checked."""


class OutsideRoots(ValueError):
    """A path (or a link in a run) that resolves outside the server's roots: one line."""


class Roots:
    """The resolved roots; :meth:`run` turns what an agent typed into a run directory inside them."""

    def __init__(self, roots: Sequence[str | Path]) -> None:
        self.roots = [Path(r).resolve(strict=True) for r in roots or [Path.cwd()]]

    def inside(self, path: Path) -> bool:
        """Whether ``path`` (resolved) lies inside a root."""
        real = path.resolve()
        return any(real == r or real.is_relative_to(r) for r in self.roots)

    def run(self, given: str) -> Path:
        """The run directory ``given`` names: absolute, or relative to a root (first found). Raises
        :class:`OutsideRoots` outside the roots, FileNotFoundError when there is no such directory."""
        text = str(given).strip()
        if not text or "\x00" in text:
            raise FileNotFoundError("run: give a run directory as list_runs names it")
        candidates = [Path(text)] if os.path.isabs(text) else [r / text for r in self.roots]
        outside = False
        for c in candidates:
            real = c.resolve()  # before any look at it: a path outside the roots is refused unseen
            if not self.inside(real):
                outside = True
                continue
            if real.exists():
                if real.is_file():
                    raise FileNotFoundError(f"{text}: a file, not a run directory")
                if real.name == schema.STRUCTURED_LOGS_DIR:
                    real = real.parent
                self.check_links(real)
                return real
        if outside:
            raise OutsideRoots(f"{text}: outside the roots this server reads ({self.describe()})")
        raise FileNotFoundError(f"{text}: no such run under {self.describe()} (list_runs names them)")

    def check_links(self, run: Path) -> None:
        """Refuse a run holding a link (within :data:`CHECK_DEPTH` levels) that resolves outside the roots."""
        for link in _links(run, CHECK_DEPTH):
            if not self.inside(link):
                raise OutsideRoots(f"{link.relative_to(run)} in {run.name} links outside the roots this "
                                   "server reads: refused")

    def output_dir(self, run: Path) -> Path:
        """``<run>/analysis``, made when missing, checked to be inside the roots (not a link out)."""
        out = run / "analysis"
        if out.is_symlink() and not self.inside(out):
            raise OutsideRoots(f"{run.name}/analysis links outside the roots: refused")
        out.mkdir(exist_ok=True)
        if not self.inside(out):
            raise OutsideRoots(f"{run.name}/analysis resolves outside the roots: refused")
        return out

    def runs(self) -> Iterator[tuple[Path, Path]]:
        """(root, run directory) of every directory holding ``structured_logs/*.jsonl*`` under a root, at
        most :data:`MAX_DEPTH` deep, links not followed, at most :data:`MAX_RUNS`."""
        found = 0
        for root in self.roots:
            for run in _walk(root, MAX_DEPTH):
                if found >= MAX_RUNS:
                    return
                found += 1
                yield root, run

    def describe(self) -> str:
        return ", ".join(map(str, self.roots))


def _has_traces(logs: Path) -> bool:
    try:
        return logs.is_dir() and not logs.is_symlink() and any(".jsonl" in e.name for e in os.scandir(logs))
    except OSError:
        return False


def _walk(root: Path, depth: int) -> Iterator[Path]:
    if _has_traces(root / schema.STRUCTURED_LOGS_DIR):
        yield root
    if depth <= 0:
        return
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False) and not e.name.startswith(".") and e.name != schema.STRUCTURED_LOGS_DIR:
            yield from _walk(Path(e.path), depth - 1)


def _links(d: Path, depth: int) -> Iterator[Path]:
    try:
        entries = list(os.scandir(d))
    except OSError:
        return
    for e in entries:
        if e.is_symlink():
            yield Path(e.path)
        elif depth > 0 and e.is_dir(follow_symlinks=False):
            yield from _links(Path(e.path), depth - 1)
