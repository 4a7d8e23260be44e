"""The communication recorder in one process (docs/comm.md, "Recording"): settings, ``set_mesh``, and a
1-process gloo group (FileStore) whose ops must come out as ``comm.*`` spans through the real runtime.

Flight Recorder's buffer size is read once per process, when the first group is made, so every
scenario that makes a group runs in a fresh Python process of its own (``run_scenario``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot
from otel_train import ConfigError, schema as S
from otel_train.config import resolve_settings

ROOT = Path(__file__).resolve().parents[1]
FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in FR_ENV:
        monkeypatch.delenv(var, raising=False)  # restored (removed) after the test, whatever init set
    yield
    ot.shutdown()


def records(save: Path) -> list[dict[str, Any]]:
    files = sorted((save / S.STRUCTURED_LOGS_DIR).glob("*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def comm_spans(recs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(start, end or None) of every comm.* span, in start order."""
    ends = {r["span_id"]: r for r in recs if r["kind"] == S.SPAN_END}
    return [(r, ends.get(r["span_id"])) for r in recs
            if r["kind"] == S.SPAN_START and S.comm_op_of(r["name"]) is not None]


def spans_by_seq(save: Path) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """comm_spans in the ops' seq order (a buffer op's span may be written before or after a later op's)."""
    return sorted(comm_spans(records(save)), key=lambda span: span[0]["attrs"][S.ATTR_COMM_SEQ])


# Settings


def test_collectives_and_fr_dir_settings_resolve_from_env_config_and_default() -> None:
    base = {"OTEL_TRAIN_SAVE_PATH": "/tmp/base"}
    default = resolve_settings(env=base)
    assert default.collectives == "auto" and default.fr_dir is None
    assert default.fr_path == os.path.join("/tmp/base", "flight_recorder")
    assert resolve_settings(env={**base, "OTEL_TRAIN_COLLECTIVES": " Off "}).collectives == "off"
    assert resolve_settings(env=base, config={"collectives": "on"}).collectives == "on"
    chosen = resolve_settings(env={**base, "OTEL_TRAIN_FR_DIR": "/tmp/frx"})
    assert chosen.fr_dir == chosen.fr_path == "/tmp/frx"
    with pytest.raises(ConfigError) as bad:
        resolve_settings(env={**base, "OTEL_TRAIN_COLLECTIVES": "sometimes"})
    assert "OTEL_TRAIN_COLLECTIVES" in str(bad.value) and "auto, on, off" in str(bad.value)
    assert "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match="collectives"):
        resolve_settings(env=base, overrides={"collectives": True})


def test_init_fails_in_one_line_on_an_unwritable_fr_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as bad:
        ot.init(save_path=tmp_path / "run", enabled=True, fr_dir=str(blocker / "fr"))
    assert "fr_dir (OTEL_TRAIN_FR_DIR)" in str(bad.value) and "\n" not in str(bad.value)
    assert not ot.is_enabled()
    assert not (tmp_path / "run" / S.STRUCTURED_LOGS_DIR).exists()  # failed before any trace file


def test_collectives_on_fails_init_when_torch_distributed_is_unavailable(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(ConfigError) as bad:
        ot.init(save_path=tmp_path, enabled=True, collectives="on")
    assert "collectives='on'" in str(bad.value) and "is_available() is False" in str(bad.value)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    ot.init(save_path=tmp_path, enabled=True, collectives="on")  # honoured: it starts
    assert ot.is_enabled()


def test_init_sets_the_flight_recorder_environment_and_says_so_in_process_start(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"  # no group existed: set for the ones to come
    prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    assert prefix.startswith(str(tmp_path / "flight_recorder" / "torch.attempt_0.")) and prefix.endswith(".rank_")
    ot.shutdown()
    start = next(r for r in records(tmp_path) if r["name"] == S.INSTANT_PROCESS_START)
    comm = start["attrs"]["comm"]
    assert comm["flight_recorder"] is True and comm["buffer_size"] == 2000 and comm["dump_prefix"] == prefix
    assert start["attrs"]["settings"]["collectives"] == "auto"


def test_user_flight_recorder_settings_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "mine_"))
    ot.init(save_path=tmp_path, enabled=True)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0" and os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "mine_")
    ot.shutdown()
    comm = next(r for r in records(tmp_path) if r["name"] == S.INSTANT_PROCESS_START)["attrs"]["comm"]
    assert comm["flight_recorder"] is False and "TORCH_FR_BUFFER_SIZE=0 set by the user" in comm["reason"]


# set_mesh


class FakeMesh:
    """What set_mesh reads of a torch DeviceMesh."""

    def __init__(self, names: tuple[str, ...] | None, shape: tuple[int, ...], coordinate: list[int] | None) -> None:
        self.mesh_dim_names, self.shape, self._coordinate = names, shape, coordinate

    def get_coordinate(self) -> list[int] | None:
        return self._coordinate


def test_set_mesh_writes_one_mesh_instant_from_keywords_or_a_device_mesh(tmp_path: Path) -> None:
    ot.init(save_path=tmp_path, enabled=True)
    ot.set_mesh(pp=(4, 1), dp=(4, 2), tp=(2, 0))
    ot.set_mesh(FakeMesh(("pp", "dp"), (2, 2), [1, 0]))
    ot.shutdown()
    meshes = [r for r in records(tmp_path) if r["name"] == S.INSTANT_MESH]
    assert [m["attrs"] for m in meshes] == [
        {"dims": {"pp": 4, "dp": 4, "tp": 2}, "coords": {"pp": 1, "dp": 2, "tp": 0}},
        {"dims": {"pp": 2, "dp": 2}, "coords": {"pp": 1, "dp": 0}},
    ]
    assert meshes[0]["caller"].split(":")[0] == __file__


@pytest.mark.parametrize("args, kwargs, error", [
    ((), {}, TypeError),
    ((), {"dp": 4}, TypeError),
    ((), {"dp": (4, True)}, TypeError),
    ((), {"dp": (4, 4)}, ValueError),
    ((), {"dp": (0, 0)}, ValueError),
    ((object(),), {}, TypeError),
    ((FakeMesh(None, (2,), [0]),), {}, ValueError),
    ((FakeMesh(("dp",), (2,), None),), {}, ValueError),
    ((FakeMesh(("dp",), (2,), [0]),), {"pp": (2, 0)}, TypeError),
])
def test_set_mesh_misuse_raises_even_when_tracing_is_off(args: tuple[Any, ...], kwargs: dict[str, Any],
                                                         error: type[Exception]) -> None:
    assert not ot.is_enabled()
    with pytest.raises(error, match="otel_train.set_mesh"):
        ot.set_mesh(*args, **kwargs)
    ot.set_mesh(dp=(2, 1))  # a right call with tracing off: nothing, no error


# One process, one gloo group: every op through the real runtime (a fresh interpreter each).

# Each scenario's group is destroyed before the interpreter exits, as a script should (docs/comm.md,
# "Exit"): gloo's worker threads left running into interpreter finalization can abort the process.
PRELUDE = """
import atexit, json, os, sys, time, threading
import torch, torch.distributed as dist
import otel_train as ot
from otel_train import runtime
save = sys.argv[1]
def group():
    store = dist.FileStore(os.path.join(save, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
def leave():  # a DDP model keeps its group's gloo threads past destroy_process_group: no finalizing under them
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
"""


def run_scenario(tmp_path: Path, body: str, *, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR", "TORCH_NCCL"))}
    full_env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_every_python_op_is_a_child_span_with_group_seq_bytes_dtype(tmp_path: Path) -> None:
    run_scenario(tmp_path, """
    ot.init(save_path=save, enabled=True)
    group()
    t = torch.ones(4)
    with ot.training_step(7):
        with ot.log_trace_span("backward"):
            dist.all_reduce(t)
            dist.all_reduce(t, async_op=True).wait()
            dist.broadcast(t, 0)
            dist.all_gather([torch.empty(4)], t)
            dist.all_gather_into_tensor(torch.empty(4), t)
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4))
            dist.barrier()
            dist.all_gather_object([None], {"a": 1})
            dist.all_reduce(torch.ones(3, dtype=torch.float16))
    assert dist.all_reduce is not dist.distributed_c10d.all_reduce.__otel_train_original__
    ot.shutdown()
    assert not hasattr(dist.all_reduce, "__otel_train_original__"), "shutdown puts the originals back"
    """)
    recs = records(tmp_path)
    spans = comm_spans(recs)
    backward = next(r for r in recs if r["kind"] == S.SPAN_START and r["name"] == "backward")
    ops = [start["name"] for start, _ in spans]
    assert ops[:7] == ["comm.all_reduce", "comm.all_reduce", "comm.broadcast", "comm.all_gather",
                       "comm.all_gather", "comm.reduce_scatter", "comm.barrier"]
    assert ops[-1] == "comm.all_reduce" and "comm.all_gather" in ops[7:-1]  # all_gather_object's own ops
    seqs = [start["attrs"][S.ATTR_COMM_SEQ] for start, _ in spans]
    assert seqs == list(range(1, len(spans) + 1))  # Flight Recorder's collective_seq_id: 1, 2, 3, ...
    for start, end in spans:
        assert end is not None and end["status"] == S.STATUS_OK and end["seq"] > start["seq"]
        assert start["parent_span_id"] == backward["span_id"] and start["step"] == 7
        assert start["tid"] == backward["tid"] and "caller" not in start
        attrs = start["attrs"]
        assert attrs[S.ATTR_COMM_GROUP] == "0" and attrs[S.ATTR_COMM_CLOCK] == S.COMM_CLOCK_HOST
        assert "comm.source" not in attrs  # seen by a wrapper, so never again from the buffer
        assert end["ts"] >= start["ts"]
    first = spans[0][0]["attrs"]
    assert (first[S.ATTR_COMM_BYTES], first[S.ATTR_COMM_DTYPE]) == (16, "float32")
    assert spans[6][0]["attrs"][S.ATTR_COMM_BYTES] == 0  # barrier
    last = spans[-1][0]["attrs"]
    assert (last[S.ATTR_COMM_BYTES], last[S.ATTR_COMM_DTYPE]) == (6, "float16")
    groups = [r for r in recs if r["name"] == S.INSTANT_COMM_GROUP]
    assert [g["attrs"] for g in groups] == [{"group": "0", "desc": "default_pg", "ranks": [0]}]
    assert groups[0]["seq"] < spans[0][0]["seq"]  # announced before its first op


def test_an_op_issued_from_cpp_comes_from_the_flight_recorder_buffer_once(tmp_path: Path) -> None:
    # A functional collective (what DTensor issues) never passes a Python wrapper: only the buffer has it.
    run_scenario(tmp_path, """
    import torch.distributed._functional_collectives as fc
    ot.init(save_path=save, enabled=True)
    group()
    t = torch.ones(8)
    with ot.training_step(1):
        dist.all_reduce(t)
        fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
        dist.all_reduce(t)
    time.sleep(1.0)
    ot.shutdown()
    """)
    spans = spans_by_seq(tmp_path)
    assert [(s["name"], s["attrs"][S.ATTR_COMM_SEQ], s["attrs"].get("comm.source")) for s, _ in spans] == [
        ("comm.all_reduce", 1, None), ("comm.all_reduce", 2, "flight_recorder"), ("comm.all_reduce", 3, None)]
    fr_start, fr_end = spans[1]
    assert fr_start["attrs"][S.ATTR_COMM_BYTES] == 32 and fr_start["attrs"][S.ATTR_COMM_DTYPE] == "float32"
    assert fr_end is not None and fr_end["status"] == S.STATUS_OK and fr_start["step"] == 1


# gloo marks a buffer op completed from its own thread a few ms after the op's result was used: a clean
# exit right after the last op found it still running (CI, a tensor-parallel job beside a busy loop).
# LAGGING makes the buffer say so until a chosen moment (every entry from the first op on reads as
# running until `hold["until"]`), the torch behaviour made certain instead of rare.
LAGGING = """
import pickle
import torch.distributed._functional_collectives as fc
from otel_train.comm import flight_recorder as fr, recorder as rec
real = fr._dump_pickle
hold = {"from": None, "until": None}
def lagging():
    dump = pickle.loads(real())
    held = hold["from"] is not None and (hold["until"] is None or time.monotonic() < hold["until"])
    for entry in dump.get("entries") or []:
        if held and entry["record_id"] >= hold["from"]:
            entry.update(state="started", retired=False, time_discovered_completed_ns=None)
    return pickle.dumps(dump)
fr._dump_pickle = lagging
ot.init(save_path=save, enabled=True)
group()
t = torch.ones(8)
fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))  # the first: its span is written at once
time.sleep(0.5)
entries = pickle.loads(real())["entries"]
hold["from"] = max(e["record_id"] for e in entries) + 1
with ot.training_step(1):
    with ot.log_trace_span("forward"):
        fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
"""


@pytest.mark.parametrize("how", ["destroy", "shutdown"])
def test_a_buffer_op_marked_done_late_at_exit_still_ends_ok(tmp_path: Path, how: str) -> None:
    # The buffer says "running" for 50 ms after the exit began: the final look reads it again until then.
    # Either way out: destroy_process_group's flush, or ot.shutdown with the group still alive.
    way_out = ("dist.destroy_process_group()\not.shutdown()" if how == "destroy" else "ot.shutdown()")
    run_scenario(tmp_path, LAGGING + f"""
hold["until"] = time.monotonic() + 0.05
{way_out}
""")
    spans = spans_by_seq(tmp_path)
    assert [s["attrs"].get("comm.source") for s, _ in spans] == ["flight_recorder"] * 2
    last_start, last_end = spans[-1]
    assert last_start["step"] == 1 and last_end is not None
    assert last_end["status"] == S.STATUS_OK, last_end  # before the fix: "incomplete"


def test_a_buffer_op_still_running_at_exit_ends_incomplete_after_the_settle_wait(tmp_path: Path) -> None:
    # One that never ends (a stuck op, as far as the buffer says) is waited for FR_SETTLE_S, then ended
    # incomplete by shutdown, as before.
    done = run_scenario(tmp_path, LAGGING + """
began = time.monotonic()
ot.shutdown()
print("SHUTDOWN_S", time.monotonic() - began, rec.FR_SETTLE_S)
""")
    waited, settle = map(float, next(l for l in done.stdout.splitlines() if l.startswith("SHUTDOWN_S")).split()[1:])
    assert waited >= settle  # the final look read the buffer until its deadline
    last_start, last_end = spans_by_seq(tmp_path)[-1]
    assert last_start["step"] == 1 and last_end is not None and last_end["status"] == S.STATUS_INCOMPLETE


def test_ddp_reducer_ops_are_one_span_each_through_the_comm_hook(tmp_path: Path) -> None:
    # The hook's all_reduce passes the wrapper and Flight Recorder holds it too: one span, not two.
    run_scenario(tmp_path, """
    from otel_train import torch as ott
    ot.init(save_path=save, enabled=True)
    group()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    handle = ott.instrument(model)
    for step in range(3):
        with ot.training_step(step):
            ott.backward(model(torch.ones(2, 8)).sum())
    model.register_comm_hook(None, lambda state, bucket: dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0]))
    with ot.training_step(3):
        ott.backward(model(torch.ones(2, 8)).sum())
    time.sleep(1.0)
    ot.shutdown()
    leave()
    """)
    recs = records(tmp_path)
    spans = comm_spans(recs)
    keys = [(s["attrs"][S.ATTR_COMM_GROUP], s["attrs"][S.ATTR_COMM_SEQ]) for s, _ in spans]
    assert len(keys) == len(set(keys)) and sorted(k[1] for k in keys) == list(range(1, len(keys) + 1))
    names = {r["span_id"]: r["name"] for r in recs if r["kind"] == S.SPAN_START}
    in_backward = [s for s, _ in spans if names.get(s.get("parent_span_id")) == "backward"]
    assert [s["step"] for s in in_backward] == [0, 1, 2, 3]  # one bucket all-reduce per step, the user's hook too
    assert all(s["name"] == "comm.all_reduce" and "comm.source" not in s["attrs"] for s in in_backward)
    assert in_backward[0]["attrs"][S.ATTR_COMM_BYTES] == (8 * 4 + 4) * 4
    construction = [s for s, _ in spans if s["attrs"].get("comm.source") == "flight_recorder"]
    # DDP's own setup (shape check, parameter and bucket broadcasts), issued from C++: from the buffer.
    assert construction and {s["name"] for s in construction} <= {"comm.broadcast", "comm.all_gather"}


def test_group_made_before_init_is_said_in_process_start_and_ddp_still_recorded(tmp_path: Path) -> None:
    run_scenario(tmp_path, """
    from otel_train import torch as ott
    group()
    ot.init(save_path=save, enabled=True)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    handle = ott.instrument(model)
    with ot.training_step(0):
        ott.backward(model(torch.ones(2, 8)).sum())
    ot.shutdown()
    leave()
    """)
    recs = records(tmp_path)
    comm = next(r for r in recs if r["name"] == S.INSTANT_PROCESS_START)["attrs"]["comm"]
    assert comm["flight_recorder"] is False and "init_process_group ran before otel_train.init" in comm["reason"]
    spans = comm_spans(recs)
    assert [s["name"] for s, _ in spans] == ["comm.all_reduce"]  # the hook's; DDP's setup ops are unseen
    assert spans[0][0]["attrs"][S.ATTR_COMM_SEQ] > 1  # the group's own counter: setup ops came first


def test_a_failing_op_raises_as_without_us_and_its_span_is_an_error(tmp_path: Path) -> None:
    done = run_scenario(tmp_path, """
    ot.init(save_path=save, enabled=True)
    group()
    with ot.training_step(0):
        for fn in (dist.broadcast.__otel_train_original__, dist.broadcast):  # without us, then with us
            try:
                fn(torch.ones(2), src=5)
            except Exception as exc:
                print("RAISED", type(exc).__name__, str(exc).splitlines()[0])
        dist.all_reduce(torch.ones(2))
    ot.shutdown()
    """)
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    assert len(raised) == 2 and raised[0] == raised[1], raised
    spans = comm_spans(records(tmp_path))
    errors = [(s["name"], e["status"], e["error"]["type"]) for s, e in spans if e["status"] != S.STATUS_OK]
    assert errors == [("comm.broadcast", S.STATUS_ERROR, raised[0].split()[1])]
    assert spans[-1][0]["name"] == "comm.all_reduce" and spans[-1][1]["status"] == S.STATUS_OK


def test_an_internal_fault_is_reported_once_and_the_call_still_runs(tmp_path: Path) -> None:
    done = run_scenario(tmp_path, """
    from otel_train.comm import patch
    ot.init(save_path=save, enabled=True)
    group()
    def broken(self, spec, args, kwargs):
        raise RuntimeError("boom in the recorder")
    patch.NoteMaker._note = broken
    t = torch.ones(2)
    for _ in range(3):
        dist.all_reduce(t)
    print("VALUE", t.tolist())
    ot.shutdown()
    """)
    assert "VALUE [1.0, 1.0]" in done.stdout
    assert done.stderr.count("boom in the recorder") == 1
    # The wrapper could not note them, so the Flight Recorder buffer is where the three ops come from.
    spans = comm_spans(records(tmp_path))
    assert [s["attrs"].get("comm.source") for s, _ in spans] == ["flight_recorder"] * 3


def test_collectives_off_patches_nothing(tmp_path: Path) -> None:
    run_scenario(tmp_path, """
    ot.init(save_path=save, enabled=True, collectives="off")
    group()
    assert not hasattr(dist.all_reduce, "__otel_train_original__")
    dist.all_reduce(torch.ones(2))
    ot.shutdown()
    """)
    recs = records(tmp_path)
    assert not comm_spans(recs) and not [r for r in recs if r["name"] == S.INSTANT_COMM_GROUP]
    comm = next(r for r in recs if r["name"] == S.INSTANT_PROCESS_START)["attrs"]["comm"]
    assert comm["recording"] is False and comm["flight_recorder"] is True  # torch's own recorder still on


def test_a_destroyed_group_is_freed_as_without_us_even_when_a_wrapper_outlives_the_session(tmp_path: Path) -> None:
    """``destroy_process_group`` frees a group when it would without otel-train (its gloo threads and
    sockets; on NCCL its communicators): the recorder's group table used to keep every group alive until
    ``shutdown``, and for ever when a module held one of our wrappers (taken from ``torch.distributed``
    while ours). After ``shutdown`` such a wrapper is the original alone."""
    done = run_scenario(tmp_path, """
    import gc, weakref
    ot.init(save_path=save, enabled=True)
    group()
    sub = dist.new_group([0])
    held = dist.broadcast  # taken while ours, as a module imported after init takes it
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    held(t, 0)
    world, sub_ref = weakref.ref(dist.group.WORLD), weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    freed = {"sub": sub_ref() is None, "world_kept": world() is not None}
    dist.all_reduce(t)  # the groups left are still recorded, their sequence going on
    dist.destroy_process_group()
    gc.collect()
    freed["world"] = world() is None
    ot.shutdown()
    # A second session whose groups are destroyed after its shutdown: its table let go of them.
    ot.init(save_path=os.path.join(save, "second"), enabled=True)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(save, "store2"), 1), rank=0, world_size=1)
    again = weakref.ref(dist.group.WORLD)
    held = dist.broadcast  # this session's wrapper, taken again
    dist.all_reduce(t)
    ot.shutdown()
    held(t, 0)  # the original alone now: no note, no reference to the group
    dist.destroy_process_group()
    gc.collect()
    freed["after_shutdown"] = again() is None
    print(json.dumps(freed))
    """)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"sub": True, "world_kept": True, "world": True,
                                                                "after_shutdown": True}
    ops = [(s["name"], s["attrs"][S.ATTR_COMM_SEQ]) for s, _ in comm_spans(records(tmp_path))]
    assert ops == [("comm.all_reduce", 1), ("comm.all_reduce", 1), ("comm.broadcast", 2), ("comm.all_reduce", 3)]


def test_torch_distributed_imported_after_init_is_patched_on_import(tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent("""
    import os, sys
    import otel_train as ot
    save = sys.argv[1]
    ot.init(save_path=save, enabled=True)
    assert "torch" not in sys.modules
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(save, "store"), 1), rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))
    ot.shutdown()
    dist.destroy_process_group()
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR"))}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [s["name"] for s, _ in comm_spans(records(tmp_path))] == ["comm.all_reduce"]


def test_sigterm_flushes_noted_ops(tmp_path: Path) -> None:
    # The recorder looks only every 60 s here: what SIGTERM's shutdown writes is all there is.
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + textwrap.dedent("""
    from otel_train.comm import recorder
    recorder.POLL_S = 60.0
    ot.init(save_path=save, enabled=True)
    group()
    with ot.training_step(0):
        for _ in range(5):
            dist.all_reduce(torch.ones(2))
        print("READY", flush=True)
        time.sleep(60)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR"))}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    recs = records(tmp_path)
    spans = comm_spans(recs)
    assert len(spans) == 5 and all(e is not None and e["status"] == S.STATUS_OK for _, e in spans)
    assert recs[-1]["name"] == S.INSTANT_PROCESS_END


def test_mesh_built_by_init_device_mesh_is_declared(tmp_path: Path) -> None:
    run_scenario(tmp_path, """
    from torch.distributed.device_mesh import init_device_mesh  # imported before init: still seen
    ot.init(save_path=save, enabled=True)
    group()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    ot.shutdown()
    """)
    meshes = [r["attrs"] for r in records(tmp_path) if r["name"] == S.INSTANT_MESH]
    assert meshes == [{"dims": {"tp": 1}, "coords": {"tp": 0}}]


def test_explicit_set_mesh_wins_over_detection(tmp_path: Path) -> None:
    run_scenario(tmp_path, """
    from torch.distributed.device_mesh import init_device_mesh
    ot.init(save_path=save, enabled=True)
    group()
    ot.set_mesh(dp=(1, 0))
    init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    ot.shutdown()
    """)
    assert [r["attrs"] for r in records(tmp_path) if r["name"] == S.INSTANT_MESH] == [
        {"dims": {"dp": 1}, "coords": {"dp": 0}}]


def test_stall_in_a_comm_span_writes_a_flight_recorder_dump_per_incident(tmp_path: Path) -> None:
    from otel_train.comm.flight_recorder import StallDumps

    script_env = {"TORCH_FR_BUFFER_SIZE": "100"}
    run_scenario(tmp_path, """
    from otel_train.comm.flight_recorder import StallDumps
    group()
    dist.all_reduce(torch.ones(3))
    dumps = StallDumps(os.path.join(save, "fr"), rank=0, attempt=2, world_size=1)
    dumps.on_stall("forward")  # not a comm span: no dump
    dumps.on_stall("comm.all_reduce")
    dumps.on_stall("comm.all_reduce")
    print(json.dumps(dumps.written))
    """, env=script_env)
    files = sorted((tmp_path / "fr").iterdir())
    assert len(files) == 2 and all("attempt_2" in f.name and f.name.endswith(".rank_0.json") for f in files)
    dump = json.loads(files[0].read_text())
    assert dump["rank"] == 0 and dump["attempt"] == 2 and dump["reason"] == "stall in comm.all_reduce"
    assert [e["profiling_name"] for e in dump["entries"]] == ["gloo:all_reduce"]
    assert StallDumps  # the same class the watchdog's callback runs


def test_recorder_turns_a_running_note_into_an_open_span_then_ends_it(tmp_path: Path) -> None:
    # Unit: the recorder with the real JSONL processor, a group stand-in and a note still running.
    from otel_train import runtime
    from otel_train.comm.groups import GroupState, GroupTable
    from otel_train.comm.notes import Note, NoteQueue
    from otel_train.comm.recorder import Recorder

    ot.init(save_path=tmp_path, enabled=True)
    rt = runtime._active
    assert rt is not None and rt.jsonl is not None
    queue, groups = NoteQueue(), GroupTable()
    state = GroupState(pg=None, name="7", desc="pp", ranks=[3, 5], op_counts_p2p=True)
    recorder = Recorder(ot.api._tracing.tracer, queue, groups, instant=rt.jsonl.instant_for)
    with ot.training_step(4):
        with ot.log_trace_span("pipeline") as outer:
            note = Note("recv", state, 1, None, 5, 64, "float32")
            queue.append(note)
    recorder.poll()
    open_now = [name for _, name, _, _ in rt.jsonl.open_spans()]
    assert open_now == ["comm.recv"]  # its start record is in the file, its end is not
    note.done()
    recorder.poll()
    assert rt.jsonl.open_spans() == []
    ot.shutdown()
    recs = records(tmp_path)
    (start, end), = comm_spans(recs)
    assert start["parent_span_id"] == format(outer.get_span_context().span_id, "016x") and start["step"] == 4
    assert start["attrs"] == {"comm.group": "7", "comm.seq": 1, "comm.peer": 5, "comm.bytes": 64,
                              "comm.dtype": "float32", "comm.clock": "host"}
    assert end["seq"] > start["seq"] and abs(start["ts"] - note.start_ns / 1e9) < 1e-5
    assert [r["attrs"] for r in recs if r["name"] == S.INSTANT_COMM_GROUP] == [
        {"group": "7", "desc": "pp", "ranks": [3, 5]}]
    time.sleep(0)  # nothing else runs here


def test_a_call_missing_its_tensor_raises_as_without_us_and_reports_nothing(tmp_path: Path) -> None:
    done = run_scenario(tmp_path, """
    ot.init(save_path=save, enabled=True)
    group()
    for fn in (dist.all_reduce.__otel_train_original__, dist.all_reduce):
        try:
            fn()
        except TypeError as exc:
            print("RAISED", exc)
    ot.shutdown()
    """)
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    assert len(raised) == 2 and raised[0] == raised[1]
    assert "otel-train" not in done.stderr  # a user's mistake is no fault of the recorder


def test_a_buffer_op_is_a_child_of_the_span_open_when_it_was_issued_even_one_closed_before_the_look(
        tmp_path: Path) -> None:
    # DDP's bucket rebuild broadcasts from C++ inside a short `forward`; the recorder's look comes later,
    # in the same step: the op belongs to `forward` (which had closed), not to `step` (open at the look).
    run_scenario(tmp_path, """
    import torch.distributed._functional_collectives as fc
    ot.init(save_path=save, enabled=True)
    group()
    t = torch.ones(8)
    fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))  # the first call is slow: not inside `forward`
    time.sleep(1.0)
    with ot.training_step(1):
        with ot.log_trace_span("forward"):
            fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
        time.sleep(1.0)  # several looks, each seeing only `step` open
    with ot.training_step(2):
        time.sleep(1.0)
    ot.shutdown()
    """)
    recs = records(tmp_path)
    names = {r["span_id"]: r["name"] for r in recs if r["kind"] == S.SPAN_START}
    (warm, _), (start, _) = sorted(comm_spans(recs), key=lambda span: span[0]["attrs"][S.ATTR_COMM_SEQ])
    assert warm["attrs"].get("comm.source") == start["attrs"].get("comm.source") == "flight_recorder"
    assert "parent_span_id" not in warm or warm["parent_span_id"] not in names
    assert names[start["parent_span_id"]] == "forward" and start["step"] == 1


def test_a_recorder_that_falls_behind_says_so_once_and_counts_every_time(capsys: pytest.CaptureFixture[str]) -> None:
    """Both hand-overs to the recorder's thread are bounded: op notes (NoteQueue) and the spans that
    ended since its last look (the feed it places Flight Recorder ops under). Full when the recorder
    takes them: one line on stderr per kind, then only counted; what is still there is taken in order."""
    from collections import deque

    from opentelemetry.sdk.trace import TracerProvider

    from otel_train import _report
    from otel_train.comm.groups import GroupTable
    from otel_train.comm.notes import NoteQueue
    from otel_train.comm.recorder import Recorder

    _report.reset()
    queue = NoteQueue(maxlen=4)
    for i in range(6):
        queue.append(i)  # type: ignore[arg-type] - the queue never looks inside a note
    assert queue.take() == [2, 3, 4, 5] and queue.take() == []
    tracer = TracerProvider().get_tracer("test")
    closed: deque[Any] = deque(maxlen=3)
    recorder = Recorder(tracer, NoteQueue(), GroupTable(), instant=lambda *_: None, closed=closed)
    for look in range(2):
        for _ in range(5):
            span = tracer.start_span("phase")
            span.end()
            closed.append((span,))
        recorder._see_spans()
    assert len(recorder._spans) == 6 and not closed  # the 3 newest of each look
    counts = _report.counts()
    assert counts.get("comm.notes_dropped") == 1 and counts.get("comm.closed_spans_dropped") == 2, counts
    err = capsys.readouterr().err
    assert err.count("oldest op notes were dropped") == 1 and err.count("ended spans") == 1, err
    _report.reset()


def test_a_buffer_op_a_rank_waits_in_is_written_before_the_paced_read(tmp_path: Path) -> None:
    # A functional collective never passes a wrapper: its span comes from the buffer, whose reads are
    # paced (here at most one every 30 s). A rank that stops issuing ops may be waiting in its last one,
    # so the look after the counters stopped moving reads the buffer at once: the op's start is on disk
    # within two looks (0.4 s), not at the next paced read.
    done = run_scenario(tmp_path, """
    import glob
    import torch.distributed._functional_collectives as fc
    from otel_train.comm import flight_recorder as fr
    fr.MIN_READ_INTERVAL_S = fr.MAX_READ_INTERVAL_S = 30.0
    ot.init(save_path=save, enabled=True)
    group()
    t = torch.ones(8)
    fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))  # read at once (the first read is due)
    time.sleep(1.0)
    with ot.training_step(1):
        fc.wait_tensor(fc.all_reduce(torch.ones(16), "sum", dist.group.WORLD))
        time.sleep(2.0)  # the rank issues nothing more: as if it waited in that op
        trace = glob.glob(os.path.join(save, "structured_logs", "*.jsonl"))[0]
        seen = [json.loads(line) for line in open(trace)]
        print(json.dumps([r["attrs"]["comm.bytes"] for r in seen if r["name"] == "comm.all_reduce"
                          and r["kind"] == "span_start"]))
    ot.shutdown()
    """)
    assert json.loads(done.stdout.splitlines()[-1]) == [32, 64]  # both buffer ops, the second while "waiting"


def test_an_arrival_with_a_parent_leaves_no_trace_id_for_a_later_span(tmp_path: Path) -> None:
    # The herald chose a trace id for every op, and the recorder asked the id generator for it before
    # starting the op's span; a span with a parent takes the parent's trace id, so the request stayed,
    # and the next span begun without a parent on the recorder's thread (a buffer op issued outside any
    # span) took the earlier op's trace.
    run_scenario(tmp_path, """
    import torch.distributed._functional_collectives as fc
    ot.init(save_path=save, enabled=True)
    group()
    t = torch.ones(4)
    with ot.log_trace_span("backward"):
        dist.all_reduce(t)
    time.sleep(0.6)  # the recorder begins the op's span
    fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))  # outside any span: its span has no parent
    time.sleep(1.0)
    ot.shutdown()
    """)
    (python_op, _), (buffer_op, _) = spans_by_seq(tmp_path)
    backward = next(r for r in records(tmp_path) if r["name"] == "backward")
    assert python_op["trace_id"] == backward["trace_id"] and python_op["parent_span_id"] == backward["span_id"]
    assert buffer_op["attrs"].get("comm.source") == "flight_recorder" and "parent_span_id" not in buffer_op
    assert buffer_op["trace_id"] != backward["trace_id"]
