"""Profiler windows in a real torchrun job (4 ranks, gloo, CPU; docs/profiling.md).

One job serves both targets, to keep the suite short: ranks 0 and 3 have a scheduled window at steps
10-12, and rank 2 is slowed in ``forward`` from step 20 with ``profile_on=straggler``. Expected: exactly
three trace files, the scheduled ones on ranks 0 and 3 and one straggler window on rank 2 starting within
3 steps of the slowdown; nothing on rank 1, no straggler window anywhere else. Then ``export --profiles``
puts the window's operator events under rank 2's ``forward`` spans.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otel_train.analysis.records import Reader, find_process_files

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
SLOW_FROM = 20
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    save = tmp_path_factory.mktemp("profiling") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OMP_NUM_THREADS="1", OTEL_TRAIN_PROFILE_RANKS="0,3", OTEL_TRAIN_PROFILE_STEPS="10-12",
               OTEL_TRAIN_PROFILE_ON="straggler")
    # --gpu-wait-ms: every rank's forward also sleeps 20 ms (steady steps on a busy CPU); rank 2's
    # forward sleeps 500 ms more from step 20 on, so its peers wait for it in the DDP all-reduce.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
           "--save-path", str(save), "--steps", "27", "--eval-every", "0", "--checkpoint-every", "0",
           "--batch-size", "16", "--hidden", "64", "--gpu-wait-ms", "20", "--slow-rank", "2",
           "--slow-phase", "forward", "--slow-ms", "500", "--slow-from", str(SLOW_FROM)]
    done = subprocess.run(cmd, cwd=save.parent, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return save, done


def profile_instants(save: Path) -> dict[int, list[dict[str, Any]]]:
    reader = Reader()
    out: dict[int, list[dict[str, Any]]] = {}
    for pf in find_process_files(save):
        out[pf.rank] = [r["attrs"] for r in reader.records(pf) if r.get("name") == "profile"]
        assert all(a["steps"][1] == r["step"] for a, r in zip(out[pf.rank], (
            r for r in Reader().records(pf) if r.get("name") == "profile")))  # carries the window's last step
    return out


def test_scheduled_windows_on_ranks_0_and_3_and_one_straggler_window_on_rank_2(job: tuple[Path, Any]) -> None:
    save, done = job
    files = sorted(str(p.relative_to(save)) for p in (save / "profiles").rglob("*") if p.is_file())
    straggler = [f for f in files if f.startswith("profiles/rank_2/")]
    assert len(straggler) == 1, files
    first, last = map(int, re.fullmatch(r"profiles/rank_2/straggler\.steps_(\d+)-(\d+)\.pt\.trace\.json",
                                        straggler[0]).groups())
    assert SLOW_FROM <= first <= SLOW_FROM + 3 and last == first + 2
    assert files == sorted(["profiles/rank_0/scheduled.steps_10-12.pt.trace.json",
                            "profiles/rank_3/scheduled.steps_10-12.pt.trace.json", straggler[0]])
    instants = profile_instants(save)
    assert {r: [(a["steps"], a["reason"], a["path"]) for a in v] for r, v in instants.items()} == {
        0: [([10, 12], "scheduled", "profiles/rank_0/scheduled.steps_10-12.pt.trace.json")], 1: [], 2: [([first, last], "straggler", straggler[0])],
        3: [([10, 12], "scheduled", "profiles/rank_3/scheduled.steps_10-12.pt.trace.json")]}


def test_no_profiler_ran_on_the_other_ranks(job: tuple[Path, Any]) -> None:
    """Kineto logs each profiler start with its pid (this torch build): only ranks 0, 2 and 3 started one."""
    save, done = job
    started = set(re.findall(r" (\d+):\d+ \S+\] profiler_start", done.stderr))
    if not started:
        pytest.skip("this torch build does not log profiler starts")
    reader = Reader()
    pids = {pf.rank: next(reader.records(pf))["pid"] for pf in find_process_files(save)}
    assert started == {str(pids[0]), str(pids[2]), str(pids[3])}


def test_export_profiles_puts_the_operators_under_rank_2s_forward(job: tuple[Path, Any]) -> None:
    save, _ = job
    out = save / "analysis" / "merged.json"
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "export", str(save), "--profiles", "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "profiles: 3 windows merged" in done.stdout
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    pid = next(e["pid"] for e in events if e.get("name") == "process_name" and e["args"]["name"] == "rank 2")
    window = next(w for w in doc["otherData"]["profiles"] if w["pid"] == pid)
    first, last = window["steps"]
    forwards = [e for e in events if e.get("name") == "forward" and e["pid"] == pid and e.get("ph") == "X"
                and first <= e["args"].get("step", -1) <= last]
    linears = [e for e in events if e.get("name") == "aten::linear" and e["pid"] == pid]
    assert len(forwards) == 3 and len(linears) == 3 * 3  # the model's three Linear layers, each step
    slack = window["align_error_us"] + 1.0  # whole µs in the export
    for op in linears:
        assert any(f["ts"] - slack <= op["ts"] and op["ts"] + op["dur"] <= f["ts"] + f["dur"] + slack
                   for f in forwards), op
        assert op["tid"] // 100_000 == pid and op["cat"].startswith("profiler.")
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name" and e["pid"] == pid}
    assert any(n.startswith("profiler: ") for n in names)


def test_summarize_lists_the_windows(job: tuple[Path, Any]) -> None:
    save, _ = job
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "summarize", str(save), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [(w["rank"], w["reason"]) for w in json.loads(done.stdout)["profiles"]]
    assert rows == [(0, "scheduled"), (2, "straggler"), (3, "scheduled")]
    text = subprocess.run([sys.executable, "-m", "otel_train.cli", "summarize", str(save)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "rank 0 profiled at steps 10\u201312: scheduled" in text
    assert re.search(r"rank 2 profiled at steps 2[0-3]\u20132[2-5]: straggler", text)


def test_export_profiles_as_perfetto_protobuf_puts_the_operators_under_rank_2s_forward(job: tuple[Path, Any]) -> None:
    # The same windows in the Perfetto format, decoded with Perfetto's own protos: a profiler track under
    # rank 2's process, its slices strictly nested, each aten::linear inside one of rank 2's forward slices.
    pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")
    save, _ = job
    out = save / "analysis" / "merged.pftrace"
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "export", str(save), "--profiles", "--format",
                           "perfetto", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "profiles: 3 windows merged" in done.stdout
    trace = pb.Trace.FromString(out.read_bytes())
    pid_of, track_pid, profiler_tracks, names = {}, {}, set(), {}
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            td = p.track_descriptor
            if td.HasField("process"):
                pid_of[td.uuid] = td.process.pid
                names[td.process.pid] = td.process.process_name
            elif td.HasField("thread"):
                track_pid[td.uuid] = td.thread.pid
            elif td.name.startswith("profiler: "):
                track_pid[td.uuid] = pid_of[td.parent_uuid]
                profiler_tracks.add(td.uuid)
    pid = next(pid for pid, name in names.items() if name.startswith("rank 2"))
    interned: dict[int, dict[int, str]] = {}
    open_: dict[int, list[tuple[str, int]]] = {}
    forwards, linears = [], []
    for p in trace.packet:
        seq = p.trusted_packet_sequence_id
        for n in p.interned_data.event_names:
            interned.setdefault(seq, {})[n.iid] = n.name
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        stack = open_.setdefault(te.track_uuid, [])
        if te.type == 1:
            stack.append((te.name or interned.get(seq, {}).get(te.name_iid, ""), p.timestamp))
        elif te.type == 2:
            name, start = stack.pop()  # an end closes the innermost open slice of its track
            if track_pid.get(te.track_uuid) != pid:
                continue
            if name == "forward":
                forwards.append((start, p.timestamp))
            elif name == "aten::linear" and te.track_uuid in profiler_tracks:
                linears.append((start, p.timestamp))
    assert all(not stack for stack in open_.values())
    assert len(linears) == 3 * 3 and forwards
    for start, end in linears:
        assert any(f0 - 100_000 <= start and end <= f1 + 100_000 for f0, f1 in forwards), (start, end)
