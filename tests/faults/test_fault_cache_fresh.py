"""The read cache and remembered results never serve a file rewritten in place, at any depth.

Two findings: a trace file rewritten in place (same inode and size, first and last 4 KiB unchanged) was
served from the cache as an unchanged prefix (the entry was "extended" by nothing); a Flight Recorder
dump four or more folders below ``--fr`` was rewritten and a remembered result still served (the
snapshot stopped at depth 4, the reader does not). What must hold (otel_train/analysis/reading/cache.py):
a rewritten segment is a miss whether or not it also grew (exact: size, ``mtime_ns``, ``ctime_ns``;
extended: the CRC of every byte that was read); a remembered result's snapshot of a declared input
reaches every level below it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from analysis_fixtures import Proc, write_run
from faultlib import reported, trials
from typer.testing import CliRunner

from otel_train import schema
from otel_train.analysis.reading import cache as C
from otel_train.analysis.records import find_process_files
from otel_train.analysis.spans import Run, load_run
from otel_train.cli import app

EDGE = C.PRINT_BYTES


def _view(run: Run) -> list[tuple]:
    return [(d.rank, d.records, d.final_step, {k: (list(v.steps), list(v.durs)) for k, v in d.phases.items()})
            for d in run.processes]


def _run(path: Path, steps: int = 200) -> list[Proc]:
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(steps))
    write_run(path, procs)
    return procs


def _rewrite_middle(path: Path, rng: random.Random, *, keep_mtime: bool) -> None:
    """Some ``"dur_ms":20.0`` in the middle (never in the first or last 4 KiB) made 29.0, in place."""
    data = path.read_bytes()
    st = path.stat()
    needle = b'"dur_ms":20.0'
    spots = [i for i in range(EDGE, len(data) - EDGE - len(needle)) if data.startswith(needle, i)]
    assert spots, "the fixture's file is too small for a middle"
    with open(path, "r+b") as f:
        for at in rng.sample(spots, k=min(len(spots), rng.randint(1, 5))):
            f.seek(at)
            f.write(b'"dur_ms":29.0')
    after = path.stat()
    assert (after.st_ino, after.st_size) == (st.st_ino, st.st_size)
    assert path.read_bytes()[:EDGE] == data[:EDGE] and path.read_bytes()[-EDGE:] == data[-EDGE:]
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_trace_file_rewritten_in_place_is_never_served(tmp_path: Path) -> None:
    holds = ("a trace file's middle rewritten in place (same inode and size, first and last 4 KiB unchanged; mtime "
             "kept or not; then also appended to): load_run and summarize --json equal a read without the cache")
    n = trials(4)
    with reported("trace file rewritten in place (same size, same edges)", holds, n):
        for trial in range(n):
            rng = random.Random(trial)
            run = tmp_path / f"run{trial}"
            procs = _run(run)
            load_run(run)  # fills the read cache
            summarized = CliRunner().invoke(app, ["summarize", str(run), "--json"])
            assert summarized.exit_code == 0, summarized.output
            path = find_process_files(run)[0].paths[-1]
            _rewrite_middle(path, rng, keep_mtime=trial % 2 == 0)
            if trial % 4 >= 2:  # rewritten and grown: the entry must not be extended either
                p = procs[0]
                before = len(p.lines)
                p.steps(range(200, 205))
                with path.open("a") as f:
                    f.write("".join(line + "\n" for line in p.lines[before:]))
            assert _view(load_run(run)) == _view(load_run(run, cache=False)), f"trial {trial}: a stale state served"
            again = CliRunner().invoke(app, ["summarize", str(run), "--json"])
            fresh = CliRunner().invoke(app, ["summarize", str(run), "--json", "--no-cache"])
            assert again.output == fresh.output and again.output != summarized.output, f"trial {trial}"


def test_a_dump_rewritten_deep_below_a_declared_input_is_never_served(tmp_path: Path) -> None:
    holds = ("a file 1 to 8 folders below a path a result declared (uses: the Flight Recorder folder) rewritten in "
             "place, same size, mtime kept: the remembered result is not served")
    depths = range(1, 9)
    with reported("dump rewritten deep below --fr (remembered result)", holds, len(depths)):
        _run(tmp_path, steps=5)
        logs = tmp_path / schema.STRUCTURED_LOGS_DIR
        for depth in depths:
            fr = tmp_path / f"fr{depth}"
            folder = fr.joinpath(*(f"d{i}" for i in range(depth)))
            folder.mkdir(parents=True)
            dump = folder / "rank_0.json"
            dump.write_text('{"entries": [1]}')
            recall = C.Recall("summarize", [logs], {"fr": str(fr)})
            with recall.recording():
                C.uses(fr)
            recall.keep({"answer": depth}, [])
            assert recall.recall() == ({"answer": depth}, []), "kept and served while unchanged"
            st = dump.stat()
            dump.write_text('{"entries": [2]}')
            os.utime(dump, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert C.Recall("summarize", [logs], {"fr": str(fr)}).recall() is None, f"served at depth {depth}"
