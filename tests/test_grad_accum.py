"""No victim named as a straggler (issue 17, item 6): gradient accumulation on real torchrun jobs.

``examples/train_grad_accum.py`` is a third-party style DDP script: ``ot.set_step`` per step (no
``step`` span), two micro-steps of data_fetch, forward, backward, ``require_backward_grad_sync`` on
only for the last (what ``no_sync`` does), rank 1 slowed in every data_fetch. Rank 0 then waits in its
last backward (the all-reduce) for rank 1: before the fix ``summarize`` named rank 0's backward as a
straggler "costing 0.0 ms" (rank 1 +20 ms; here +40 ms, so that a loaded machine, which delays rank 0
too, cannot take the waiting away from enough steps). It is run three ways (30 steps each): the
default (``collectives=auto``: comm spans from the Flight Recorder buffer only), with
``otel_train.torch.instrument`` (the DDP comm hook: host-timed ``comm.all_reduce`` spans), and with
``OTEL_TRAIN_COLLECTIVES=off`` (phase spans only). The slowness is a busy loop (``--slow-how spin``):
after a sleep the next forward runs measurably slower on this machine (cold caches, about 2x a 0.4 ms
forward), a true but tiny excess of rank 1's that this test is not about (docs/analysis.md "Victims").

The assertions are about the structure of the findings, not about timings agreeing between runs.
A synthetic run (exact timings, no step spans) checks each of the two rules on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import collective, declare

from otel_train.analysis import findings as findings_module
from otel_train.analysis.spans import Run, load_run
from otel_train.analysis.stats import per_step
from otel_train.analysis.summary import summarize
from otel_train.analysis.whatif import whatif
from otel_train.phases import BACKWARD, DATA_FETCH, FORWARD, OPTIMIZER

pytest.importorskip("torch.distributed")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_grad_accum.py"
SLOW_RANK, STEPS, SLOW_MS = 1, 30, 40
VARIANTS = {"fr": ((), {}), "hook": (("--instrument",), {}), "off": ((), {"OTEL_TRAIN_COLLECTIVES": "off"})}


def _job(save_path: Path, args: tuple[str, ...], env_extra: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
           "--save-path", str(save_path), "--steps", str(STEPS), "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS),
           "--slow-how", "spin", *args]
    proc = subprocess.Popen(cmd, cwd=save_path.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and its ranks share the session started above
        out, _ = proc.communicate()
        pytest.fail(f"the job did not finish in 240 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grad_accum")
    paths = {}
    for name, (args, env) in VARIANTS.items():
        paths[name] = root / name
        _job(paths[name], args, env)
    return paths


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_only_the_slow_ranks_data_fetch_is_named(runs: dict[str, Path], variant: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run = load_run(runs[variant], warn=pytest.fail)
    # The victim situation happened, as strongly as when it showed the defect: without the rules that
    # keep a victim out (and without the comm graph), rank 0's backward, where it waited, is named.
    # (Not "rank 0 waited longer in 90 % of the steps": beside a busy loop, rank 0 was itself 40 ms late
    # in 5 of 20 steps once, and the sign test needs only 16 of 20.)
    backward = {d.rank: per_step(d, BACKWARD)[1] for d in run.processes}
    assert sorted(backward) == [0, 1] and all(b.size == STEPS for b in backward.values())
    assert (0, BACKWARD) in _named_without_the_victim_rules(run, monkeypatch), backward
    found = summarize(runs[variant], warn=pytest.fail)["findings"]
    # Rank 0, the victim, is named nowhere; rank 1's data_fetch is named once, and is what costs most.
    assert [f for f in found if f["rank"] != SLOW_RANK or f["kind"] != "straggler"] == [], found
    assert [f["phase"] for f in found].count(DATA_FETCH) == 1, found
    top = max(found, key=lambda f: f["cost_ms"])
    assert top["phase"] == DATA_FETCH and top["cost_ms"] > 0 and "costs" in top["message"], found
    # (On a quiet machine that is the only finding; at 6 runnable processes per CPU rank 1's own
    # forward ran 1.8 ms slower once, the busy loop costing it its CPU share: named, rightly, as rank 1's.)
    pair = whatif(run)["by_rank_phase"][0]
    assert (pair["rank"], pair["phase"]) == (SLOW_RANK, DATA_FETCH)


def _named_without_the_victim_rules(run: Run, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(rank, phase) of the straggler rule's findings with neither victim rule and no comm graph: what
    named rank 0's backward before the fix (test_each_rule_alone_keeps_the_victim_out, last case)."""
    with monkeypatch.context() as m:
        m.setattr(findings_module, "_step_children", lambda group, names: set())
        m.setattr(findings_module, "_absorbed", lambda f, cost: False)
        found = findings_module.straggler_findings(run.groups()[0], run.phase_order(), graph=None)
    return [(f["rank"], f["phase"]) for f in found]


def test_the_three_runs_saw_the_communication_they_were_meant_to(runs: dict[str, Path]) -> None:
    def all_reduces(name: str) -> list:
        run = load_run(runs[name], warn=pytest.fail)
        return [op for g in run.comm.values() for op in g.all_ops() if op.op == "all_reduce" and op.step is not None]

    assert len(all_reduces("hook")) >= 2 * STEPS  # one per step and rank at least (DDP's bucket all-reduces)
    assert all_reduces("off") == []  # collectives=off: the phase rule alone decides


# ---------------------------------------------------------------------------------------------
# The same shape with exact timings: rank 1 +20 ms per data_fetch, 2 micro-steps, no step span.


def _accum_run(tmp_path: Path, comm: bool) -> Path:
    procs = [Proc(rank=r) for r in range(2)]
    if comm:
        declare(procs)
    for s in range(30):
        for p in procs:
            p.set_step(s)
        for micro in range(2):
            for p in procs:
                for name, ms in ((DATA_FETCH, 1.0 + (20.0 if p.rank == SLOW_RANK else 0.0) + 0.1 * (s % 3)),
                                 (FORWARD, 5.0)):
                    p.start(name)
                    p.advance(ms)
                    p.end()
                p.start(BACKWARD)
                p.advance(8.0)
            if micro == 1:  # the sync: everyone leaves 2 ms after the last arrival
                if comm:
                    collective(procs, "all_reduce", "0", s)
                else:
                    last = max(p.now_ms for p in procs)
                    for p in procs:
                        p.now_ms = last + 2.0
            for p in procs:
                p.end()
        for p in procs:
            p.start(OPTIMIZER)
            p.advance(3.0)
            p.end()
            p.advance(0.5)
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    return tmp_path


@pytest.mark.parametrize("comm", [False, True])
def test_each_rule_alone_keeps_the_victim_out(tmp_path: Path, comm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    run = load_run(_accum_run(tmp_path, comm), warn=pytest.fail)
    group, order = run.groups()[0], run.phase_order()
    graph = next(iter(run.comm.values()), None) if comm else None

    def named() -> list[tuple[int, str]]:
        return [(f["rank"], f["phase"]) for f in findings_module.straggler_findings(group, order, graph=graph)]

    assert named() == [(SLOW_RANK, DATA_FETCH)]
    # The cost rule alone (top-level phases not treated as one step's sequence): still only rank 1.
    with monkeypatch.context() as m:
        m.setattr(findings_module, "_step_children", lambda group, names: set())
        assert named() == [(SLOW_RANK, DATA_FETCH)]
    # The lateness rule alone (no cost check).
    with monkeypatch.context() as m:
        m.setattr(findings_module, "_absorbed", lambda f, cost: False)
        assert named() == [(SLOW_RANK, DATA_FETCH)]
    # Neither: without comm spans rank 0's backward is named, the defect of issue 17; with them the
    # comm graph's waiting (the time its all_reduce waited for rank 1) keeps it out on its own.
    with monkeypatch.context() as m:
        m.setattr(findings_module, "_step_children", lambda group, names: set())
        m.setattr(findings_module, "_absorbed", lambda f, cost: False)
        assert (0, BACKWARD) not in named() if comm else (0, BACKWARD) in named()
