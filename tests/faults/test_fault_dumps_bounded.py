"""Hostile Flight Recorder dumps (issue 48, items 2, 4 – 7): dump reading is bounded and total.

The dump folder is the one ``--fr`` names or, by default, the one a trace's own ``process_start``
names as ``fr_dir``: a trace file chooses what is opened. Beside the real dumps of ranks 0 and 1
(``tests/data/fr``, torch 2.13 on gloo) each test plants what a copied, shared or hostile run
directory can hold, and runs the real CLI in a child with a 3 GB address-space limit (the code before
the fix allocated until memory ran out) and a deadline (it hung on a FIFO, and spun for hours on a
shape bomb):

* a pickle of 4,000 references to one entry whose shape is 20,000 × 2**64;
* ``rank: 10**12`` in a dump, a number in a file name (``notes-20261207.txt``);
* one odd value per dump: ``'²'``, ``'--5'``, a 5,000-digit string, ``nccl:send 0->²``, a group name
  nested 200,000 deep;
* a FIFO named ``rank_1.json``, a link ``rank_1.pkl -> /dev/zero``, a dump five folder levels down,
  120 files that are no dump.

What must hold: every command exits 0 in bounded time; the good dumps are read (their ops, ranks 0
and 1); each bad file or odd value is skipped with a line naming it and counted; no rank past the
run's world is ever taken; non-regular files are never opened; a dump below ``FR_MAX_DEPTH`` folder
levels is not read (the read cache's snapshot looks exactly that deep).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import declare, dp_steps
from faultlib import reported

from otel_train.analysis.flight_recorder import MAX_FILE_LINES
from otel_train.analysis.reading.fr_files import FR_MAX_DEPTH

DATA = Path(__file__).resolve().parents[1] / "data" / "fr"
DEADLINE_S = 90
"""A generous bound for one command on a loaded machine (each takes about a second here); the code
before the fix never ended on the shape bomb or the FIFO."""
LIMIT = r"""
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
if sys.argv[1] == "-c":
    code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
    exec(compile(code, "<read>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__")
"""
READ = r"""
import json, sys
from otel_train.analysis.flight_recorder import read_dumps
d = read_dumps(sys.argv[1], world_size=int(sys.argv[2]))
print(json.dumps({"ranks": sorted(d.ranks), "missing": d.missing[:20], "n_missing": len(d.missing),
                  "incidents": sorted([str(i.path), i.rank, i.ops] for i in d.incidents),
                  "ops": sorted([o.rank, o.group, o.seq, o.op] for o in d.ops if o.rank in (0, 1)),
                  "odd": d.odd_values, "skipped": sorted(map(str, d.skipped)), "warnings": d.warnings}))
"""


def _run(tmp: Path, world: int = 4, fr_dir: Path | None = None) -> Path:
    """A 4-rank run of 3 data-parallel steps (trace files as the sink writes them)."""
    procs = [Proc(rank=r, world_size=world) for r in range(world)]
    if fr_dir is not None:
        for p in procs:  # the trace's own process_start names the dump folder
            first = json.loads(p.lines[0])
            first["attrs"]["settings"] = {"fr_dir": str(fr_dir)}
            p.lines[0] = json.dumps(first)
    declare(procs)
    dp_steps(procs, range(3))
    write_run(tmp / "run", procs)
    return tmp / "run"


def _good(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("fr_trace_0", "fr_trace_1"):
        shutil.copy(DATA / name, folder / name)
    return folder


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", LIMIT, "otel_train.cli", *args], capture_output=True,
                              text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"otel-train {' '.join(args)}: still running after {DEADLINE_S} s")
    done.took = time.monotonic() - t0  # type: ignore[attr-defined]
    return done


def _read(folder: Path, world: int = 4) -> dict:
    try:
        done = subprocess.run([sys.executable, "-c", LIMIT, "-c", READ, str(folder), str(world)],
                              capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"read_dumps({folder}): still running after {DEADLINE_S} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _commands(run: Path, fr: Path | None) -> None:
    """summarize, export and watch exit 0 in bounded time, each bad file named on stderr."""
    given = ["--fr", str(fr)] if fr is not None else []
    for args in (["summarize", str(run), "--json", *given], ["export", str(run), "-o", str(run / "t.json"), *given],
                 ["watch", str(run), "--json", "--timeout", "3", *given]):
        done = _cli(*args)
        assert done.returncode == 0, (args[0], done.stderr[-3000:])
        assert "Traceback" not in done.stderr and "Flight Recorder dumps not read" not in done.stderr, (args[0], done.stderr[-3000:])


GOOD_OPS = 16  # fr_trace_0 and fr_trace_1: 7 ops of group 0 and 1 of group 1 each
_NEST = b"X\x08\x00\x00\x00__NEST__"


def _entry(seq: int, **over: object) -> dict:
    entry = {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": [[4]], "op_id": seq,
             "process_group": ["0", "default_pg"], "profiling_name": "nccl:all_reduce", "retired": True,
             "state": "completed", "time_created_ns": 1_796_160_398_358_444_924 + seq}
    entry.update(over)
    return entry


def _nested_group_pickle(depth: int) -> bytes:
    """A dump whose one odd entry's group name is a list nested ``depth`` deep (built by the unpickler
    without recursion, as a planted file would be), and one good entry."""
    dump = {"rank": 2, "entries": [_entry(1), _entry(2, process_group=["__NEST__", "default_pg"])]}
    data = pickle.dumps(dump, protocol=2)
    assert data.count(_NEST) == 1
    return data.replace(_NEST, b"]" * depth + b"a" * (depth - 1))


ODD = {
    "seq '²'": lambda: json.dumps({"rank": 2, "entries": [_entry(1), _entry(2, collective_seq_id="²")]}),
    "op_id '--5'": lambda: json.dumps({"rank": 2, "entries": [_entry(1), _entry(2, op_id="--5")]}),
    "5,000-digit time": lambda: json.dumps({"rank": 2, "entries": [_entry(1), _entry(2, time_created_ns="9" * 5000)]}),
    "nccl:send 0->²": lambda: json.dumps({"rank": 2, "entries": [_entry(1), _entry(2, profiling_name="nccl:send 0->²")]}),
    "group nested 200,000 deep": lambda: _nested_group_pickle(200_000),
}


def test_odd_values_are_skipped_and_counted_and_cost_no_good_dump(tmp_path: Path) -> None:
    holds = ("one odd value per dump ('²', '--5', a 5,000-digit string, nccl:send 0->², a group name nested "
             "200,000 deep): summarize, export, watch exit 0; each counted and named in one line; the good "
             "dumps (ranks 0, 1) and the dump's other entries read")
    with reported("odd values in Flight Recorder dumps", holds, len(ODD)):
        fr = _good(tmp_path / "run" / "flight_recorder")
        for i, (label, make) in enumerate(ODD.items()):
            data = make()
            (fr / f"odd{i}.rank_2.{'pkl' if isinstance(data, bytes) else 'json'}").write_bytes(
                data if isinstance(data, bytes) else data.encode())
        run = _run(tmp_path)
        _commands(run, None)
        got = _read(fr)
        assert [r for r in got["ranks"]] == [0, 1, 2], got["warnings"]
        assert len(got["ops"]) == GOOD_OPS, got["warnings"]  # the good dumps, untouched
        odd = [i for i in got["incidents"] if ".rank_2." in i[0]]
        assert len(odd) == len(ODD), got["warnings"]
        kept = 2  # an odd op_id or time leaves the op (that field unknown); an odd identity skips the entry
        assert sum(i[2] for i in odd) == len(ODD) + kept, odd
        assert got["odd"] == len(ODD), got["warnings"]
        said = [w for w in got["warnings"] if "odd value" in w]
        assert len(said) == len(ODD) and all("\n" not in w and len(w) < 400 for w in said), said


def test_shape_bomb_and_absurd_ranks_are_bounded(tmp_path: Path) -> None:
    holds = ("a 4,000-reference pickle with shape 20,000 x 2**64, rank 10**12 in a dump, notes-20261207.txt: "
             "summarize, export, watch exit 0 within the deadline; no rank past the world (4) named or "
             "missing; the good dumps read")
    with reported("shape bomb and absurd ranks in Flight Recorder dumps", holds, 3):
        fr = _good(tmp_path / "run" / "flight_recorder")
        bomb = _entry(3, input_sizes=[[2**64] * 20_000], input_dtypes=["Float"])
        (fr / "bomb.rank_3.pkl").write_bytes(pickle.dumps({"entries": [bomb] * 4_000}, protocol=4))
        assert (fr / "bomb.rank_3.pkl").stat().st_size < 300_000
        (fr / "huge.json").write_text(json.dumps({"rank": 10**12, "entries": [_entry(1)]}))
        (fr / "notes-20261207.txt").write_text("20261207: the nodes were drained\n")
        run = _run(tmp_path)
        _commands(run, None)
        got = _read(fr)
        assert got["ranks"] == [0, 1, 3] and got["missing"] == [2] and got["n_missing"] == 1, got["warnings"]
        assert len(got["ops"]) == GOOD_OPS, got["warnings"]
        assert any("huge.json" in w and "outside the run's world" in w for w in got["warnings"]), got["warnings"]
        assert got["odd"] >= 1  # the bomb's sizes: unknown, counted
        dumps_only = _read(fr, world=0)  # no trace: the world is bounded all the same
        assert dumps_only["n_missing"] <= 4, dumps_only


def test_fifos_links_and_deep_dumps_are_never_opened(tmp_path: Path) -> None:
    holds = ("a FIFO named rank_1.json and a link rank_1.pkl -> /dev/zero in the dump folder a trace's own "
             "process_start names, a dump 5 folder levels down: summarize, export and watch (--fr FIFO too) "
             "exit 0 in bounded time; neither is opened; the deep dump is not read; the good dumps are")
    with reported("FIFO, /dev/zero link and a deep dump in the Flight Recorder folder", holds, 3):
        fr = _good(tmp_path / "elsewhere" / "fr")
        os.mkfifo(fr / "rank_1.json")
        os.symlink("/dev/zero", fr / "rank_1.pkl")
        levels = [f"l{i}" for i in range(FR_MAX_DEPTH)]  # fr/l0/l1/l2/l3: one level past the limit
        deep = fr.joinpath(*levels)
        deep.mkdir(parents=True)
        shutil.copy(DATA / "later" / "host-a.rank0.pkl", deep / "host-a.rank0.pkl")
        shallow = fr.joinpath(*levels[:-1])
        shutil.copy(DATA / "later" / "host-b.rank1.pkl", shallow / "host-b.rank1.pkl")
        for i in range(120):  # no dumps: with the FIFO and the link, 122 lines about single files, 50 said
            (fr / f"notes{i}.txt").write_text("not a dump\n")
        run = _run(tmp_path, fr_dir=fr)
        _commands(run, None)  # the trace's fr_dir
        done = _cli("watch", str(run), "--json", "--timeout", "3", "--fr", str(fr))
        assert done.returncode == 0, done.stderr[-2000:]
        done = _cli("summarize", str(run), "--fr", str(fr / "rank_1.json"))
        assert done.returncode == 0 and "FIFO" in done.stderr, done.stderr[-2000:]
        got = _read(fr)
        assert got["ranks"] == [0, 1], got["warnings"]
        paths = [i[0] for i in got["incidents"]]
        assert str(shallow / "host-b.rank1.pkl") in paths and str(deep / "host-a.rank0.pkl") not in paths, paths
        assert any("FIFO" in w and "rank_1.json" in w for w in got["warnings"]), got["warnings"]
        assert any("symbolic link" in w and "rank_1.pkl" in w for w in got["warnings"]), got["warnings"]
        assert any("deeper than" in w for w in got["warnings"]), got["warnings"]
        assert len(got["warnings"]) <= MAX_FILE_LINES + 3 and "72 more warnings" in got["warnings"][-2], got["warnings"][-3:]
