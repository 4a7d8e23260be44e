"""``otel-train whatif --plot FILE``: the slowdown heatmap, rank × phase, as PNG or SVG."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from sync_sim import base, simulate
from typer.testing import CliRunner

from otel_train.analysis.plot import heatmap_grid
from otel_train.analysis.spans import load_run
from otel_train.analysis.whatif import whatif
from otel_train.cli import app
from otel_train.phases import DATA_FETCH

pytest.importorskip("matplotlib")


def straggler_run(path: Path) -> Path:
    def times(rank: int, step: int) -> dict[str, float]:
        t = base(rank, step)
        if rank == 2:
            t[DATA_FETCH] += 20.0
        return t

    procs = [Proc(rank=r, world_size=4) for r in range(4)]
    simulate(procs, 21, times)
    write_run(path, procs)
    return path


def test_the_brightest_cell_is_the_straggler_and_its_phase(tmp_path: Path) -> None:
    ranks, phases, grid = heatmap_grid(whatif(load_run(straggler_run(tmp_path / "run"), warn=pytest.fail)))
    assert ranks == [0, 1, 2, 3] and phases[0] == DATA_FETCH
    worst = max(((v, ranks[i], phases[j]) for i, row in enumerate(grid) for j, v in enumerate(row)))
    assert worst[1:] == (2, DATA_FETCH) and worst[0] > 1.3, grid
    assert all(v == pytest.approx(1.0, abs=0.05) for i, row in enumerate(grid) for v in row if ranks[i] != 2)


@pytest.mark.parametrize("name, magic", [("heat.png", b"\x89PNG\r\n\x1a\n"), ("heat.svg", b"<?xml")])
def test_plot_writes_png_or_svg_by_suffix(tmp_path: Path, name: str, magic: bytes) -> None:
    run = straggler_run(tmp_path / "run")
    out = tmp_path / "plots" / name
    result = CliRunner().invoke(app, ["whatif", str(run), "--json", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(magic) and out.stat().st_size > 5_000
    assert f"heatmap: {out}" in result.stderr
    if name.endswith(".svg"):
        assert "rank 2" in out.read_text() and DATA_FETCH in out.read_text()


def test_another_suffix_is_one_line(tmp_path: Path) -> None:
    run = straggler_run(tmp_path / "run")
    result = CliRunner().invoke(app, ["whatif", str(run), "--plot", str(tmp_path / "heat.txt")])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1 and "*.png or *.svg" in result.stderr
