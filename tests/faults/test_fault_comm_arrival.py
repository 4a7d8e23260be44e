"""An op's arrival is on disk before the op is handed to the backend (docs/comm.md, "Recording").

The recorder's thread writes a comm span up to ``POLL_S`` after the op was issued; a rank that died
before then lost its arrival at its last op, and ``summarize`` blamed it for never issuing the op it
had issued. The start record is now written by the issuing thread (otel_train/comm/herald.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from faultlib import assert_gapless, reported, traces

from otel_train import schema as S

SELF_KILL = textwrap.dedent("""
    import os, signal, sys
    import torch, torch.distributed as dist
    import otel_train as ot
    run = sys.argv[1]
    ot.init(save_path=run, enabled=True)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(run, "store"), 1), rank=0, world_size=1)
    t = torch.ones(4)
    with ot.training_step(0):
        with ot.log_trace_span("backward"):
            dist.all_reduce(t)
            work = dist.all_reduce(torch.ones(8), async_op=True)  # handed to gloo: on disk already
            os.kill(os.getpid(), signal.SIGKILL)
""")

# Two ranks issue all_reduce #13 of the default group with 4 and 8 elements; rank 1 then raises. gloo's
# I/O thread on rank 0 finds the size mismatch and aborts the process (gloo::EnforceNotMet, uncaught:
# SIGABRT), so rank 0's file ends without process_end: its arrival at #13 is what shows the desync.
DESYNC = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(12):
        with ot.training_step(step):
            with ot.log_trace_span("forward"):
                dist.all_reduce(torch.ones(4))
    with ot.training_step(12):
        with ot.log_trace_span("metrics"):
            if rank == 1:
                dist.all_reduce(torch.ones(8), async_op=True)
                raise RuntimeError("rank 1 fails after issuing its op")
            dist.all_reduce(torch.ones(4))
""")


def test_an_op_issued_then_sigkilled_at_once_has_its_arrival_on_disk(tmp_path: Path) -> None:
    holds = "the start record of an op handed to gloo is in the file when the call returns (SIGKILL right after)"
    with reported("SIGKILL right after an async all_reduce is issued", holds, 1):
        script, run = tmp_path / "job.py", tmp_path / "run"
        script.write_text(SELF_KILL)
        run.mkdir()
        done = subprocess.run([sys.executable, str(script), str(run)], capture_output=True, text=True, timeout=120)
        assert done.returncode == -9, done.stderr[-2000:]
        (trace,) = traces(run)
        assert not trace.torn
        assert_gapless(trace)
        last = trace.records[-1]
        assert (last[S.KIND], last[S.NAME]) == (S.SPAN_START, "comm.all_reduce"), [r[S.EVENT] for r in trace.records]
        assert last[S.ATTRS]["comm.seq"] == 2 and last[S.ATTRS]["comm.bytes"] == 32
        backward = next(r for r in trace.records if r[S.NAME] == "backward")
        assert last[S.PARENT_SPAN_ID] == backward[S.SPAN_ID]  # a child of the span that issued it


def test_a_rank_aborted_by_gloo_after_issuing_its_op_is_a_desync_not_a_crash(tmp_path: Path) -> None:
    holds = ("rank 0, aborted by gloo (SIGABRT) right after issuing all_reduce #13 with 16 B, has that arrival on "
             "disk; summarize names the desync (rank 1, both sizes) and no crash or hang of rank 0")
    with reported("a desync that makes gloo abort the waiting rank", holds, 1):
        script, run = tmp_path / "job.py", tmp_path / "run"
        script.write_text(DESYNC)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), str(run)], capture_output=True, text=True, timeout=180, env=env)
        by_rank = {t.records[0][S.RANK]: t for t in traces(run)}
        last = by_rank[0].records[-1]
        assert (last[S.NAME], last[S.ATTRS]["comm.seq"], last[S.ATTRS]["comm.bytes"]) == ("comm.all_reduce", 13, 16)
        out = subprocess.run([sys.executable, "-m", "otel_train.cli", "summarize", str(run), "--json"],
                             capture_output=True, text=True, timeout=120)
        findings = json.loads(out.stdout)["findings"]
        desync = [f for f in findings if f["kind"] == "desync"]
        assert len(desync) == 1 and desync[0]["rank"] == 1 and desync[0]["comm"]["seq"] == 13, findings
        assert "16 B" in desync[0]["message"] and "32 B" in desync[0]["message"], desync
        assert desync[0]["victims"] == [0]
        assert not [f for f in findings if f["kind"] in ("crash", "hang") and f["rank"] == 0], findings
