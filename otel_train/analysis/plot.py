"""The what-if heatmap (``otel-train whatif --plot FILE``): attributed slowdown, data-parallel rank ×
pipeline stage for a run with a mesh, rank × phase without.

A renderer of :func:`otel_train.analysis.whatif.whatif`'s answer, nothing more. With a mesh
(``by_cell``, the ``typical`` method) each cell is the step time with only the ranks at that
(dp, pp) coordinate as measured, all else typical, over the ideal step: a slow worker is one bright
cell, a slow stage a bright column, a slow replica a bright row. Without one each cell is the
slowdown of the step made by that rank's slowness in that phase (``by_rank_phase``), 1.0 where the
pair costs nothing. The brightest cell is where the step's time goes. PNG or SVG by the file's suffix, drawn
with matplotlib (the ``analysis`` extra), headless. Text from trace files (phase names) is drawn as
plain text, never parsed as mathtext (docs/analysis.md, "What-if heatmap").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from otel_train.analysis.outputs import replacing

SUFFIXES = (".png", ".svg")
MAX_PHASES = 24
"""Phases drawn at most (those that cost the most); the rest are left out of the picture, not of --json."""


def heatmap_grid(result: dict[str, Any]) -> tuple[list[int], list[str], list[list[float]]]:
    """(ranks, phases, slowdown[rank][phase]) from a whatif answer; phases ordered by their cost."""
    pairs = result.get("by_rank_phase") or []
    cost: dict[str, float] = {}
    for p in pairs:
        cost[p["phase"]] = cost.get(p["phase"], 0.0) + max(0.0, float(p.get("cost_ms") or 0.0))
    phases = sorted(cost, key=lambda n: -cost[n])[:MAX_PHASES]
    ranks = sorted({int(r["rank"]) for r in result.get("by_rank") or []} | {int(p["rank"]) for p in pairs})
    grid = [[1.0] * len(phases) for _ in ranks]
    where = {(r, n): (i, j) for i, r in enumerate(ranks) for j, n in enumerate(phases)}
    for p in pairs:
        cell = where.get((int(p["rank"]), p["phase"]))
        if cell is not None:
            grid[cell[0]][cell[1]] = float(p["slowdown"])
    return ranks, phases, grid


def mesh_grid(result: dict[str, Any]) -> tuple[list[int], list[int], list[list[float]]]:
    """(dp indices, pp stages, slowdown[dp][pp]) from a ``typical`` answer's ``by_cell`` (empty without a
    mesh with both dims); a cell no rank holds is 1.0."""
    cells = result.get("by_cell") or []
    dps = sorted({int(c["dp"]) for c in cells})
    pps = sorted({int(c["pp"]) for c in cells})
    grid = [[1.0] * len(pps) for _ in dps]
    for c in cells:
        grid[dps.index(int(c["dp"]))][pps.index(int(c["pp"]))] = float(c["slowdown"])
    return dps, pps, grid


def _labels(result: dict[str, Any]) -> tuple[list[str], list[str], list[list[float]], str]:
    """Row labels, column labels, the grid and what it shows: dp × pp with a mesh, else rank × phase."""
    dps, pps, grid = mesh_grid(result)
    if dps and pps:
        return [f"dp {d}" for d in dps], [f"stage {p}" for p in pps], grid, "data-parallel rank × pipeline stage"
    ranks, phases, grid = heatmap_grid(result)
    return [f"rank {r}" for r in ranks], phases, grid, "rank × phase"


def write_heatmap(result: dict[str, Any], path: str | Path) -> Path:
    """Draw the heatmap of ``result`` into ``path`` (``.png`` or ``.svg``); ValueError for another suffix
    or an answer with nothing to draw (OutputError, one, for a target that is not a regular file),
    ImportError without matplotlib."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--plot {path}: the heatmap is written as PNG or SVG; name the file *.png or *.svg")
    rows, cols, grid, what = _labels(result)
    if not rows or not cols:
        raise ValueError(f"--plot {path}: no rank and phase to draw (whatif replayed no steps)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(2.4 + 0.75 * len(cols), 1.6 + 0.45 * len(rows)), layout="constrained")
    try:
        image = ax.imshow(grid, cmap="magma", aspect="auto", vmin=1.0, vmax=max(1.0001, max(map(max, grid))))
        ax.set_xticks(range(len(cols)), cols, rotation=40, ha="right", usetex=False)
        for label in ax.get_xticklabels():
            label.set_parse_math(False)  # a phase name is data, not mathtext
        ax.set_yticks(range(len(rows)), rows)
        ms = result.get("step_ms") or {}
        ax.set_title(f"what-if slowdown ({result.get('method', 'peers')})\nper {what}\n(step {ms.get('actual', 0):.1f} ms, "
                     f"ideal {ms.get('ideal', 0):.1f} ms)", fontsize=9)
        fig.colorbar(image, ax=ax, label="slowdown")
        with replacing(path, "--plot") as f:  # never a device, FIFO or folder; 0644 at most, whatever the umask
            fig.savefig(f, format=path.suffix.lower()[1:])
    finally:
        plt.close(fig)
    return path


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported with group and other write taken off the umask:
    the font cache it makes on first use (``$XDG_CACHE_HOME/matplotlib``) is never group- or
    world-writable either (docs/reliability.md)."""
    old = os.umask(0o022)
    os.umask(old | 0o022)
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        from matplotlib import pyplot as plt
    finally:
        os.umask(old)
    return plt
