"""Flight Recorder dumps read as comm ops: real dumps (tests/data/fr, made by tests/fr_dumps.py with
torch 2.13 on gloo), a refused pickle, garbage and truncated files, a missing rank, two incidents."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from otel_train.analysis.comm import SOURCE_FR, CommOp, Group
from otel_train.analysis.flight_recorder import RefusedPickle, read_dumps, safe_loads

DATA = Path(__file__).parent / "data" / "fr"
COLLECTIVES_0 = ["all_reduce", "broadcast", "all_gather", "all_gather", "barrier", "all_to_all", "all_reduce"]


def _copy(tmp_path: Path, *names: str) -> Path:
    d = tmp_path / "fr"
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(DATA / name, d / Path(name).name)
    return d


def _ops_of(dumps, rank: int, group: str = "0") -> list[CommOp]:
    return sorted((o for o in dumps.ops if o.rank == rank and o.group == group), key=lambda o: o.seq)


@pytest.mark.parametrize("name", ["fr_trace_0", "rank_0.json"])
def test_real_dump_read_as_ops(tmp_path: Path, name: str) -> None:
    lines: list[str] = []
    dumps = read_dumps(_copy(tmp_path, name, name.replace("0", "1")), warn=lines.append)
    assert lines == [] and dumps.skipped == [] and dumps.missing == []
    assert {i.format for i in dumps.incidents} == {"json" if name.endswith(".json") else "pickle"}
    assert dumps.ranks == {0, 1}
    ops = _ops_of(dumps, 0)
    assert [o.op for o in ops] == COLLECTIVES_0
    assert [o.seq for o in ops] == list(range(1, 8))
    assert all(o.source == SOURCE_FR and o.state == "completed" and o.end == o.start for o in ops)
    first = ops[0]
    assert (first.nbytes, first.dtype, first.clock) == (16, "float32", "host")  # torch.ones(4)
    assert (ops[4].op, ops[4].nbytes) == ("barrier", 0)
    assert (ops[6].nbytes, ops[6].dtype) == (4, "float16")
    assert 1.7e9 < first.start < 4e9 and ops[6].start > first.start
    sub = _ops_of(dumps, 1, "1")
    assert [(o.op, o.seq, o.nbytes, o.dtype) for o in sub] == [("all_reduce", 1, 24, "int64")]
    assert dumps.groups["0"] == Group("0", "default_pg", (0, 1))  # gloo: no pg_config, default = world
    assert dumps.groups["1"].desc == "undefined"


def test_pickle_and_json_dumps_agree(tmp_path: Path) -> None:
    a = read_dumps(_copy(tmp_path / "a", "fr_trace_0", "fr_trace_1"))
    b = read_dumps(_copy(tmp_path / "b", "rank_0.json", "rank_1.json"))
    assert a.ops == b.ops and a.groups == b.groups


def test_pickle_with_a_global_is_refused_in_one_line(tmp_path: Path) -> None:
    d = _copy(tmp_path, "fr_trace_0", "fr_trace_1")
    evil = d / "fr_trace_2"
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil.write_bytes(pickle.dumps({"entries": [], "x": Boom()}))
    lines: list[str] = []
    dumps = read_dumps(d, warn=lines.append)
    assert not marker.exists()
    refused = [line for line in lines if "refused" in line]
    assert len(refused) == 1 and "\n" not in refused[0]
    assert str(evil) in refused[0] and "system" in refused[0]  # names the file and what was refused
    assert dumps.skipped == [evil]
    assert {i.rank for i in dumps.incidents} == {0, 1} and len(_ops_of(dumps, 1)) == 7  # the rest still read
    assert dumps.missing == [2]  # rank 2's only dump was refused: it is named missing
    with pytest.raises(RefusedPickle):
        safe_loads(pickle.dumps(Path("x")))
    assert safe_loads(pickle.dumps({"a": [1, 2.5, (None, True)], "b": {b"x"}, "c": frozenset({1})})) == {
        "a": [1, 2.5, (None, True)], "b": {b"x"}, "c": frozenset({1})}


def test_garbage_and_truncated_files_skipped_one_line_each(tmp_path: Path) -> None:
    d = _copy(tmp_path, "fr_trace_0", "rank_1.json")
    (d / "fr_trace_5").write_bytes((DATA / "fr_trace_1").read_bytes()[:700])  # truncated pickle
    (d / "rank_6.json").write_text((DATA / "rank_1.json").read_text()[:900])  # truncated JSON
    (d / "notes_rank7.txt").write_bytes(b"\x00\x01garbage")
    (d / "rank_8.json").write_text(json.dumps({"hello": 1}))  # JSON, but no dump
    lines: list[str] = []
    dumps = read_dumps(d, warn=lines.append)
    skipped_lines = [line for line in lines if "skipped" in line]
    assert len(skipped_lines) == 4 and all("\n" not in line and "Traceback" not in line for line in lines)
    assert sorted(p.name for p in dumps.skipped) == ["fr_trace_5", "notes_rank7.txt", "rank_6.json", "rank_8.json"]
    assert {i.rank for i in dumps.incidents} == {0, 1}
    assert dumps.missing == [2, 3, 4, 5, 6, 7, 8]


def test_missing_rank_named_not_fatal(tmp_path: Path) -> None:
    lines: list[str] = []
    dumps = read_dumps(_copy(tmp_path, "fr_trace_1"), warn=lines.append)
    assert dumps.missing == [0] and dumps.ranks == {1}
    assert any("no dump for rank 0" in line for line in lines)
    assert len(_ops_of(dumps, 1)) == 7
    assert read_dumps(_copy(tmp_path / "w", "fr_trace_0"), world_size=4).missing == [1, 2, 3]
    with_group = read_dumps(_copy(tmp_path / "g", "fr_trace_0"), groups=[Group("tp", "tp", (0, 5))])
    assert 5 in with_group.missing
    assert read_dumps(tmp_path / "nowhere").ops == []


def test_two_incidents_of_one_rank_both_kept(tmp_path: Path) -> None:
    d = _copy(tmp_path, "fr_trace_0", "fr_trace_1", "later/host-a.rank0.pkl", "later/host-b.rank1.pkl")
    dumps = read_dumps(d)
    assert sorted((i.rank, i.path.name) for i in dumps.incidents) == [
        (0, "fr_trace_0"), (0, "host-a.rank0.pkl"), (1, "fr_trace_1"), (1, "host-b.rank1.pkl")]
    ops = _ops_of(dumps, 0)
    keys = [(o.group, o.seq, o.op) for o in ops]
    assert len(keys) == len(set(keys)) == 8  # seen twice, kept once; the later incident's extra op too
    waiting = [o for o in dumps.ops if o.waiting]
    assert [(o.rank, o.group, o.seq, o.op, o.nbytes) for o in waiting] == [(0, "0", 8, "all_reduce", 24)]
    assert len(_ops_of(dumps, 1)) == 7


def test_rank_from_the_dump_or_the_name(tmp_path: Path) -> None:
    raw = safe_loads((DATA / "fr_trace_0").read_bytes())
    d = tmp_path / "names"
    d.mkdir()
    names = {"nccl_trace_rank_3": None, "host-a.rank4.pkl": None, "fr_trace_7": None, "dump.pkl": 9,
             "attempt_2/rank_10.json": None}
    for name, own in names.items():
        body = dict(raw, rank=own) if own is not None else raw
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_bytes(json.dumps(body).encode() if name.endswith(".json") else pickle.dumps(body))
    dumps = read_dumps(d)
    got = {i.path.name: (i.rank, i.attempt) for i in dumps.incidents}
    assert got == {"nccl_trace_rank_3": (3, 0), "host-a.rank4.pkl": (4, 0), "fr_trace_7": (7, 0),
                   "dump.pkl": (9, 0), "rank_10.json": (10, 2)}


def test_p2p_names_and_per_pair_seq(tmp_path: Path) -> None:
    """NCCL names p2p entries ``nccl:send 0->1`` / ``nccl:recv 1<-0`` (group ranks); gloo's Flight
    Recorder does not record p2p, so these entries are written the way NCCL's are."""
    def entry(i: int, name: str, pg: str = "0") -> dict:
        return {"pg_id": int(pg == "pp"), "process_group": [pg, "pp" if pg == "pp" else "default_pg"],
                "collective_seq_id": 0, "p2p_seq_id": i, "op_id": i, "profiling_name": name,
                "time_created_ns": 1_800_000_000_000_000_000 + i, "input_sizes": [[2, 3]],
                "input_dtypes": ["BFloat16"], "output_sizes": [[2, 3]], "output_dtypes": ["BFloat16"],
                "state": "completed", "time_discovered_started_ns": 0,
                "time_discovered_completed_ns": 1_800_000_000_000_000_000 + 50_000 + i, "retired": True}
    dump = {"version": "2.10", "pg_config": {"pp": {"name": "pp", "desc": "pp", "ranks": "[4, 6]"}},
            "entries": [entry(1, "nccl:send 0->1"), entry(2, "nccl:send 0->1"), entry(3, "nccl:recv 0<-1"),
                        entry(4, "nccl:send 0->1", "pp"), entry(5, "nccl:coalesced"),
                        entry(6, "nccl:frobnicate")]}
    (tmp_path / "rank_4.json").write_text(json.dumps(dump))
    lines: list[str] = []
    dumps = read_dumps(tmp_path, warn=lines.append)
    got = [(o.op, o.group, o.peer, o.seq, o.nbytes, o.dtype) for o in dumps.ops]
    assert got == [("send", "0", 1, 1, 12, "bfloat16"), ("send", "0", 1, 2, 12, "bfloat16"),
                   ("recv", "0", 1, 1, 12, "bfloat16"), ("send", "pp", 6, 1, 12, "bfloat16")]
    assert all(o.end is not None and o.end > o.start for o in dumps.ops)  # NCCL times: the real end
    assert any("frobnicate" in line for line in lines)


def test_hostile_entries_never_raise(tmp_path: Path) -> None:
    """Fields of the wrong type, absurd numbers, deep nesting: skipped or read as unknown, never raised."""
    good = json.loads((DATA / "rank_0.json").read_text())["entries"][0]
    weird: list = [None, 1, "x", [], {"profiling_name": 5}, {"profiling_name": "gloo:"},
                   dict(good, process_group=7, collective_seq_id="9", time_created_ns=10**400),
                   dict(good, input_sizes=[["a"]], input_dtypes=[None], op_id=[1], retired="yes"),
                   dict(good, input_sizes=[[2**40, 2**40]], time_created_ns=-5, thread_id={"a": 1}),
                   dict(good, profiling_name="nccl:send x->y"), dict(good, profiling_name="nccl:recv 1<-")]
    dump = {"version": 3, "pg_config": {"a": 1, "b": {"name": ["x"], "ranks": "[1, "}, "c": {"ranks": [0, "1"]}},
            "pg_status": {"0": "x", "1": {"last_completed_collective": "zz"}}, "entries": weird}
    (tmp_path / "rank_0.json").write_text(json.dumps(dump))
    (tmp_path / "rank_1.pkl").write_bytes(b"\x80\x04" + b"]" * 200_000)  # 200,000 lists and no STOP
    (tmp_path / "rank_2.json").write_text("[" * 100_000)  # nested past any recursion limit
    lines: list[str] = []
    dumps = read_dumps(tmp_path, warn=lines.append)
    assert [i.rank for i in dumps.incidents] == [0]
    assert sorted(p.name for p in dumps.skipped) == ["rank_1.pkl", "rank_2.json"]
    assert all("\n" not in line for line in lines)
    assert all(isinstance(o.seq, int) and (o.start is None or o.start >= 0) for o in dumps.ops)
