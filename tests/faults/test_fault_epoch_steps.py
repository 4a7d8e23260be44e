"""Steps that repeat every epoch (issue 19, item 10): the README's own loop, ``for step, batch in
enumerate(loader)`` inside an epoch loop with ``ot.training_step(step, epoch=epoch)``.

The analyses number such steps globally (docs/analysis.md, "The span model"): epoch e's step s is
the sum over earlier epochs of (that epoch's highest step + 1) plus s, as the process saw it; steps
that never repeat stay as written. Before, every analysis keyed on ``step`` alone: ``whatif``
replayed 14 steps of 45, ``stats`` had 15 rows per rank (each the sum of three epochs), the
straggler finding said "+28 ms per step" and "costs 0.0 ms".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from faultlib import reported

from otel_train import schema as S
from otel_train.analysis.findings import straggler_findings
from otel_train.analysis.live import LiveRun
from otel_train.analysis.records import Instant, Scalar, SpanEnd, SpanStart
from otel_train.analysis.spans import ProcessState, load_run

CLI = Path(sys.executable).with_name("otel-train")
EPOCHS, STEPS, SLOW_MS = 3, 15, 28.0

JOB = r"""
import os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import otel_train as ot

save, epochs, steps, slow_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ot.init(save_path=save, enabled=True)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4, 8), torch.randn(4, 2)
loader = [(x, y)] * steps
for epoch in range(epochs):
    for step, (bx, by) in enumerate(loader):          # the README's loop: step restarts every epoch
        with ot.training_step(step, epoch=epoch):
            with ot.log_trace_span("data_fetch"):
                time.sleep(0.002 + (slow_ms / 1000.0 if rank == 1 and epoch == 0 else 0.0))
            with ot.log_trace_span("forward"):
                loss = nn.functional.mse_loss(model(bx), by)
            with ot.log_trace_span("backward"):
                loss.backward()
            with ot.log_trace_span("optimizer"):
                opt.step()
                opt.zero_grad()
dist.destroy_process_group()
ot.shutdown()
os._exit(0)  # DDP keeps gloo's threads past destroy_process_group: no finalizing under them (docs/comm.md, "Exit")
"""


def _cli(*args: str) -> dict:
    done = subprocess.run([str(CLI), *args, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("epochs")
    script, save = root / "job.py", root / "run"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH"))}
    env.update(OMP_NUM_THREADS="1", OTEL_TRAIN_HEARTBEAT_S="0")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           str(script), str(save), str(EPOCHS), str(STEPS), str(SLOW_MS)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return save


def test_every_analysis_numbers_repeating_steps_globally(run: Path) -> None:
    total = EPOCHS * STEPS
    holds = ("3 ranks x 3 epochs x 15 steps (step restarts every epoch), rank 1 +28 ms in data_fetch in epoch 0: "
             "stats 45 rows per rank labelled (epoch, step); whatif replays 44 of 45; rank 1's cost is priced; "
             "no straggler claims a cost of 0; goodput loses nothing; --steps, export, diff, watch agree")
    with reported("steps that repeat every epoch (the README's enumerate(loader) loop)", holds, 1):
        stats = _cli("stats", str(run))
        by_rank: dict[int, list[dict]] = {}
        for row in stats["steps"]:
            by_rank.setdefault(row["rank"], []).append(row)
        assert sorted(by_rank) == [0, 1, 2]
        for rank, rows in by_rank.items():
            assert [r["step"] for r in rows] == list(range(total)), rank
            assert [(r["epoch"], r["epoch_step"]) for r in rows] == [(e, s) for e in range(EPOCHS) for s in range(STEPS)]
        slow = [r["phases"]["data_fetch"] for r in by_rank[1]]
        assert min(slow[:STEPS]) >= SLOW_MS  # one step's own time, not three epochs' sum
        assert sorted(slow[STEPS:])[len(slow[STEPS:]) // 2] < SLOW_MS / 2

        window = _cli("stats", str(run), "--steps", f"{STEPS}-{2 * STEPS - 1}", "--no-cache")  # epoch 1
        assert sorted({(r["step"], r["epoch"], r["epoch_step"]) for r in window["steps"]}) == \
            [(STEPS + s, 1, s) for s in range(STEPS)] and len(window["steps"]) == 3 * STEPS

        whatif = _cli("whatif", str(run))
        assert whatif["steps"] == total - 1  # every step but the first (warm-up) is replayed
        top = whatif["by_rank_phase"][0]
        assert (top["rank"], top["phase"]) == (1, "data_fetch"), whatif["by_rank_phase"][:3]
        assert top["cost_ms"] > SLOW_MS * STEPS / total / 4  # 28 ms over a third of the steps: ~9 ms a step

        summary = _cli("summarize", str(run))
        assert [p["final_step"] for p in summary["processes"]] == [total - 1] * 3
        for f in summary["findings"]:
            assert f["kind"] != "straggler" or (f["cost_ms"] or 0) >= 1.0, f  # never "+28 ms ... costs 0.0 ms"
        assert summary["goodput"]["lost_s"] == 0.0
        # Over epoch 0 (global steps 0-14) rank 1 is the straggler, priced, its worst step labelled.
        (group,) = load_run(run).groups()
        (found,) = [f for f in straggler_findings(group, window=(0, STEPS - 1)) if f["kind"] == "straggler"]
        assert (found["rank"], found["phase"]) == (1, "data_fetch")
        assert f"(epoch 0, step {found['step']})" in found["message"] and found["cost_ms"] > SLOW_MS / 4, found

        diff = subprocess.run([str(CLI), "diff", str(run), str(run)], capture_output=True, text=True, timeout=120)
        assert diff.returncode == 0 and f"on the {total} steps both ran" in diff.stdout, diff.stdout[:400]

        out = run.parent / "trace.json"
        subprocess.run([str(CLI), "export", str(run), "-o", str(out)], check=True, capture_output=True, timeout=120)
        events = json.loads(out.read_text())["traceEvents"]
        steps = {}
        for e in events:
            if e.get("ph") == "X" and e.get("name") == "step":
                steps.setdefault(e["pid"], []).append(e["args"]["step"])
        assert [sorted(v) for v in steps.values()] == [list(range(total))] * 3

        live = LiveRun(run)
        live.poll()
        assert sorted((r["rank"], r["step"]) for r in live.rows()) == [(0, total - 1), (1, total - 1), (2, total - 1)]


def _rec(kind: type, seq: int, step: int | None, epoch: int | None, name: str = "step", sid: str = "",
         **extra: object) -> object:
    return kind(v=1, ts=1_700_000_000.0 + seq, name=name, span_id=sid or None, step=step, epoch=epoch, **extra)


def _steps(items: list[tuple[int | None, int]]) -> list:
    """A step span per (epoch, step), in order."""
    out: list = []
    for i, (epoch, step) in enumerate(items):
        sid = f"{i:016x}"
        out.append(_rec(SpanStart, 2 * i, step, epoch, sid=sid))
        out.append(_rec(SpanEnd, 2 * i + 1, step, epoch, sid=sid, dur_ms=1.0, status=S.STATUS_OK))
    return out


def _fed(records: list, batch: int = 3) -> ProcessState:
    state = ProcessState("training", 0, 0)
    for i in range(0, len(records), batch):  # small batches: an epoch change falls inside and between them
        state.feed(records[i:i + batch])
    return state


def test_the_numbering_rule() -> None:
    holds = "global step = sum of earlier epochs' (highest step + 1) + step; steps that never repeat unchanged"
    with reported("step numbering across epochs (the rule's cases)", holds, 5):
        repeating = _fed(_steps([(e, s) for e in range(3) for s in range(4)]))
        assert list(repeating.phases["step"].steps) == list(range(12))
        assert repeating.epochs == [(0, 0, 0), (4, 1, 4), (8, 2, 8)] and repeating.final_step == 11
        assert repeating.step_text(6) == "6 (epoch 1, step 2)"
        # A global counter (steps never repeat): nothing changes, and nothing is labelled.
        counter = _fed(_steps([(e, 4 * e + s) for e in range(3) for s in range(4)]))
        assert list(counter.phases["step"].steps) == list(range(12)) and not counter.renumbered
        assert counter.step_text(6) == "6"
        # One step per epoch: the repeat is a step that does not go forward.
        single = _fed(_steps([(0, 0), (1, 0), (2, 0)]))
        assert list(single.phases["step"].steps) == [0, 1, 2]
        # No epoch at all: as written.
        plain = _fed(_steps([(None, 0), (None, 1), (None, 0)]))
        assert list(plain.phases["step"].steps) == [0, 1, 0]
        # A late record of an older epoch (the comm recorder's thread) takes that epoch's numbering,
        # and an instant and a scalar of the current epoch take the current one.
        records = _steps([(0, 0), (0, 1), (1, 0)])
        records.append(_rec(Instant, 10, 1, 0, name="late"))
        records.append(_rec(Scalar, 11, 0, 1, name="scalar"))
        state = ProcessState("training", 0, 0, keep=True)
        state.feed(records)
        assert [r.step for r in state.instants] == [1] and [r.step for r in state.scalars] == [2]
        assert state.final_step == 2
