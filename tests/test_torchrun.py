"""The DDP example under a real ``torchrun`` (gloo on CPU): files, run context, nesting, DataLoader
workers, lifecycle records, secrets, and an injected failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from otel_train import phases, schema
from otel_train.analysis.records import Reader, find_process_files
from otel_train.lifecycle import EXCEPTION_INSTANT, REDACTED

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
SECRET = "s3cr3t-value-never-in-files"
STEP_PHASES = [phases.DATA_FETCH, phases.BATCH_TO_DEVICE, phases.FORWARD, phases.BACKWARD, phases.OPTIMIZER]


def torchrun(save_path: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(MY_API_TOKEN=SECRET, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(EXAMPLE), "--save-path", str(save_path), *args]
    return subprocess.run(cmd, cwd=save_path.parent, env=env, capture_output=True, text=True, timeout=240)


def records_by_rank(save_path: Path) -> dict[int, list[dict[str, Any]]]:
    reader = Reader()
    files = find_process_files(save_path)
    by_rank = {pf.rank: list(reader.records(pf)) for pf in files}
    assert reader.malformed_lines == 0 and len(by_rank) == len(files)
    return by_rank


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save_path = tmp_path_factory.mktemp("ddp") / "run"
    done = torchrun(save_path, "--steps", "4", "--num-workers", "2", "--checkpoint-every", "2",
                    "--eval-every", "0", "--batch-size", "16")
    assert done.returncode == 0, done.stderr[-3000:]
    return save_path


def test_one_file_per_rank_with_run_context_on_every_record(clean_run: Path) -> None:
    by_rank = records_by_rank(clean_run)
    assert sorted(by_rank) == [0, 1]
    run_ids = set()
    for rank, records in by_rank.items():
        assert {r["rank"] for r in records} == {rank}
        assert {r["world_size"] for r in records} == {2}
        run_ids |= {r["run_id"] for r in records}
        seqs = [r["seq"] for r in records]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert len(run_ids) == 1


def test_steps_nest_every_phase_and_carry_step_context(clean_run: Path) -> None:
    for records in records_by_rank(clean_run).values():
        starts = [r for r in records if r["kind"] == schema.SPAN_START]
        steps = {r["span_id"]: r["step"] for r in starts if r["name"] == phases.STEP}
        assert sorted(steps.values()) == [0, 1, 2, 3]
        for span_id, step in steps.items():
            children = [r for r in starts if r.get("parent_span_id") == span_id]
            expected = STEP_PHASES + ([phases.CHECKPOINT] if step == 2 else [])
            assert [c["name"] for c in children] == expected
        # Everything recorded inside a step (spans, scalars, log instants) carries that step.
        inside = [r for r in records if r.get("parent_span_id") in steps or
                  (r["kind"] in (schema.SCALAR, schema.INSTANT) and r.get("span_id") in steps)]
        assert inside and all(r["step"] == steps.get(r.get("parent_span_id"), steps.get(r.get("span_id")))
                              for r in inside)
        names = Counter(r["name"] for r in starts)
        assert names[phases.EVAL] == 1 and names["build.model"] == names["build.data"] == 1


def test_dataloader_workers_add_no_records(clean_run: Path) -> None:
    by_rank = records_by_rank(clean_run)
    for records in by_rank.values():
        assert len({r["pid"] for r in records}) == 1  # the rank's own process only
        fetches = [r for r in records if r["kind"] == schema.SPAN_END and r["name"] == phases.DATA_FETCH]
        assert len(fetches) == 4 and {r["status"] for r in fetches} == {schema.STATUS_OK}
    assert len(list((clean_run / schema.STRUCTURED_LOGS_DIR).iterdir())) == 2  # a trace file per rank, no more
    assert len(list((clean_run / schema.DIGESTS_DIR).glob("*" + schema.DIGEST_SUFFIX))) == 2  # a digest for each


def test_lifecycle_records_and_redacted_environment(clean_run: Path) -> None:
    for records in records_by_rank(clean_run).values():
        start = next(r for r in records if r["name"] == schema.INSTANT_PROCESS_START)
        assert start["attrs"]["env"]["MY_API_TOKEN"] == REDACTED
        assert start["attrs"]["launcher"] == "torchrun" and start["attrs"]["versions"]["torch"]
        assert records[-1]["name"] == schema.INSTANT_PROCESS_END
        logs = [r for r in records if r["name"] == "log"]
        assert all(r["attrs"]["logger"] == "train_ddp" for r in logs)
    for path in (clean_run / schema.STRUCTURED_LOGS_DIR).iterdir():
        assert SECRET not in path.read_text()


def test_injected_failure_writes_an_exception_instant(tmp_path: Path) -> None:
    save_path = tmp_path / "run"
    done = torchrun(save_path, "--steps", "3", "--fail-rank", "1", "--fail-step", "1", "--eval-every", "0",
                    "--checkpoint-every", "0", "--timeout-s", "10")
    assert done.returncode != 0
    failed = records_by_rank(save_path)[1]
    exc = next(r for r in failed if r["name"] == EXCEPTION_INSTANT)
    assert exc["step"] == 1 and exc["attrs"]["message"] == "injected failure on rank 1 at step 1"
    assert exc["attrs"]["traceback"][-1].endswith(":inject")
    forward = next(r for r in failed if r["kind"] == schema.SPAN_END and r["name"] == phases.FORWARD
                   and r["step"] == 1)
    assert forward["status"] == schema.STATUS_ERROR
    assert json.dumps(failed).count(SECRET) == 0
