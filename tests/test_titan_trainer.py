"""torchtitan's real trainer (0.3.0: llama3 debugmodel, 2 ranks, FSDP2 over gloo, CPU) under torchrun,
with faults injected by tests/titan_trainer.py (issue 44, item 3): read from torchtitan's own files,
and through ``otel_train.titan.register_handler``. Each fault names the right rank and phase, and
no other rank as its culprit. Skipped, with the reason, when torchtitan is not installed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests import titan_env  # noqa: E402

if titan_env.python() is None:
    pytest.skip(titan_env.MISSING, allow_module_level=True)

from otel_train.analysis.spans import use_run  # noqa: E402
from otel_train.analysis.summary import summarize  # noqa: E402

WRAPPER = Path(__file__).with_name("titan_trainer.py")
TORCHRUN = titan_env.torchrun()
BOTH = ("torchtitan.observability.structured_logger.jsonl_handler.register_jsonl_handler,"
        "otel_train.titan.register_handler")
LIMIT_S = 240.0


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan")
    subprocess.run([str(titan_env.python()), str(WRAPPER), "--make-assets", str(root)], check=True, timeout=120)
    return root


def _start(root: Path, dump: Path, *, steps: int, fault: str | None, factory: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_TRAIN_", "TITAN_"))}
    env.update(HF_HOME=str(root / "hf"), TITAN_FAULT_MARK=str(dump), OMP_NUM_THREADS="1")
    if fault:
        env["TITAN_FAULT"] = fault
    if factory:
        env["TITAN_STRUCT_LOGGER_HANDLERS"] = BOTH
    dump.mkdir(parents=True)
    port = _free_port()
    argv = [str(TORCHRUN), "--nproc_per_node=2", f"--master_port={port}", str(WRAPPER),
            "--module", "llama3", "--config", "llama3_debugmodel", "--dump_folder", str(dump),
            "--training.steps", str(steps), "--training.local_batch_size", "1", "--training.seq_len", "64",
            "--parallelism.spmd_backend", "partial_dtensor", "--checkpoint.no-enable", "--validator.no-enable",
            "--metrics.no-enable-tensorboard"]
    with (dump / "torchrun.log").open("wb") as log:  # a file, never a pipe nobody reads while it runs
        return subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _free_port() -> int:
    with socket.socket() as sock:  # a port no earlier job of this file still holds (TIME_WAIT included)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log(dump: Path) -> str:
    return (dump / "torchrun.log").read_text(errors="replace")[-3000:]


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _wait_until(proc: subprocess.Popen, done: callable) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before the fault showed (exit {proc.returncode})")
        if time.monotonic() > deadline:
            _kill(proc)
            raise AssertionError(f"not seen within {LIMIT_S:.0f} s")
        time.sleep(0.2)


def _rank_file_has(dump: Path, rank: int, *needles: str) -> bool:
    for path in (dump / "structured_logs").glob(f"*.global_rank_{rank}.*.jsonl"):
        text = path.read_text(errors="replace")
        if '"log_type_name"' in text and all(n in text for n in needles):
            return True
    return False


def _findings(dump: Path, run: str | None = None) -> list[tuple[str, int | None, str | None]]:
    use_run(run)
    try:
        s = summarize(dump, cache=False, warn=lambda _: None)
    finally:
        use_run(None)
    return [(f["kind"], f["rank"], f["phase"]) for f in s["findings"]]


def _our_run(dump: Path) -> str:
    from otel_train.analysis.reading.discovery import find_process_files
    from otel_train.analysis.reading.whole import head

    ids = {head(pf).run_id for pf in find_process_files(dump, warn=lambda _: None)} - {"torchtitan"}
    (run,) = ids
    return run


def test_a_clean_run_reads_as_finished_and_through_the_factory_records_fsdp_collectives(assets: Path) -> None:
    dump = assets / "clean"
    proc = _start(assets, dump, steps=3, fault=None, factory=True)
    assert proc.wait(timeout=LIMIT_S) == 0, _log(dump)
    s = summarize(dump, cache=False, warn=lambda _: None)  # the default: theirs, the run started last
    assert [(p["rank"], p["format"], p["final_step"], p["open_spans"]) for p in s["processes"]] == \
        [(0, "torchtitan", 3, []), (1, "torchtitan", 3, [])]
    assert s["findings"] == []
    assert {"step", "fetching_batch", "fwd_bwd", "optim"} <= {p["name"] for p in s["phases"]}
    use_run(_our_run(dump))
    try:
        ours = summarize(dump, cache=False, warn=lambda _: None)
    finally:
        use_run(None)
    counts = {p["name"]: p["count"] for p in ours["phases"]}
    assert counts["fwd_bwd"] == 6 and counts.get("comm.all_gather", 0) > 0 and counts.get("comm.reduce_scatter", 0) > 0
    assert ours["findings"] == []


def test_a_hang_in_data_loading_from_their_files(assets: Path) -> None:
    dump = assets / "hang_data"
    proc = _start(assets, dump, steps=4, fault="hang_data:1:3", factory=False)
    # rank 0 has loaded step 3's batch and counted its tokens: the next all_reduce waits for rank 1
    _wait_until(proc, lambda: (dump / "fault.1").exists() and _rank_file_has(dump, 0, '"step": 3', '"local_valid_tokens"'))
    _kill(proc)
    got = _findings(dump)
    assert got[0] == ("hang", 1, "fetching_batch") and all(r != 0 for _, r, _ in got), got


def test_a_slow_data_load_from_their_files(assets: Path) -> None:
    dump = assets / "slow_data"
    proc = _start(assets, dump, steps=4, fault="slow_data:1:3:4", factory=False)
    assert proc.wait(timeout=LIMIT_S) == 0, _log(dump)
    s = summarize(dump, cache=False, warn=lambda _: None)
    fetch = next(p for p in s["phases"] if p["name"] == "fetching_batch")
    assert (fetch["slowest"]["rank"], fetch["slowest"]["step"]) == (1, 3) and fetch["max_ms"] >= 4000
    assert all(f["rank"] != 0 for f in s["findings"]), s["findings"]


def test_a_rank_killed_in_forward_from_their_files(assets: Path) -> None:
    dump = assets / "kill_forward"
    proc = _start(assets, dump, steps=4, fault="kill_forward:1:3", factory=False)
    _wait_until(proc, lambda: proc.poll() is not None or (dump / "fault.1").exists())
    proc.wait(timeout=LIMIT_S)  # torchrun ends the job once rank 1 is gone
    _kill(proc)
    got = _findings(dump)
    assert got[0] == ("crash", 1, "fwd_bwd") and all(r != 0 for _, r, _ in got), got


def test_a_hang_in_forward_through_the_factory(assets: Path) -> None:
    dump = assets / "hang_forward"
    proc = _start(assets, dump, steps=4, fault="hang_forward:1:3", factory=True)
    # rank 0 waits in a collective of step 3's forward: our file has that comm span open
    _wait_until(proc, lambda: (dump / "fault.1").exists() and _comm_open(dump, 0, 3))
    _kill(proc)
    got = _findings(dump, _our_run(dump))
    assert got[0][:2] == ("hang", 1) and got[0][2] == "fwd_bwd" and all(r != 0 for _, r, _ in got), got


@pytest.mark.xfail(strict=True, reason=(
    "not found: rank 1 is last at the first all_gather of each step, 1 of about 34 collectives a step "
    "under FSDP2, and the arrival rule names a rank last at >= 90 % of them (ARRIVAL_MIN_SHARE); the "
    "phase rule sees both ranks' fwd_bwd grow alike (the waiting is inside it). The comm view shows it: "
    "rank 0 waits the slowdown at that all_gather every step"))
def test_a_slow_forward_through_the_factory(assets: Path) -> None:
    dump = assets / "slow_forward"
    proc = _start(assets, dump, steps=12, fault="slow_forward:1:3+:0.3", factory=True)
    assert proc.wait(timeout=LIMIT_S) == 0, _log(dump)
    use_run(_our_run(dump))
    try:
        s = summarize(dump, cache=False, warn=lambda _: None)
    finally:
        use_run(None)
    assert all(f["rank"] != 0 for f in s["findings"]), s["findings"]
    assert [(f["kind"], f["rank"]) for f in s["findings"]][:1] == [("straggler", 1)], s["findings"]


def _comm_open(dump: Path, rank: int, step: int) -> bool:
    from otel_train.analysis.reading.discovery import find_process_files
    from otel_train.analysis.reading.whole import Reader
    from otel_train.analysis.spans import read_process

    for pf in find_process_files(dump, warn=lambda _: None):
        if pf.rank != rank:
            continue
        state = read_process(pf, 0, Reader(warn=lambda _: None))
        if state.format == "otel-train" and any(u.name.startswith("comm.") and u.step == step for u in state.unclosed):
            return True
    return False
