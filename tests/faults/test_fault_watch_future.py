"""``watch`` on a live run (issue 48, items 8 and 10): a dump file rewritten while it watches, and one
record stamped an hour ahead.

* ``watch --fr FILE`` read the file once: a dump written after that was never read (a folder worked).
  Here watch follows a run whose processes are alive on this host; once it has read the first dump
  (its warning about rank 0's missing dump is on stderr), the file is rewritten with rank 1's next op
  (a ``broadcast`` where rank 0 waits in an ``all_reduce`` of the same seq): watch must read it and
  name the ``desync``.
* A real training process whose runtime clock reads an hour ahead for one span's end (its
  ``forward`` of step 5), then stops inside ``data_fetch`` for good: before the fix, progress was the
  newest end time seen, so ``watch --exit-on hang`` never named the hang (nothing in 40 s; 3.4 s
  without the odd record). Progress is now judged on each process's own recent records: the record
  from the future is reported once and not taken as progress, and the hang is named.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from analysis_fixtures import Proc
from comm_sim import declare, dp_steps, open_op
from faultlib import reported

from otel_train import schema

DEADLINE_S = 60
"""watch's --timeout: the finding comes within seconds (a dump is looked at every 5 s; stall_min_s 1 s)."""


def _settings(p: Proc, **values: object) -> None:
    first = json.loads(p.lines[0])
    first["attrs"]["settings"] = {"stall_min_s": 1.0, "heartbeat_s": 10.0, **values}
    p.lines[0] = json.dumps(first)


def _dump(seq: int, op: str) -> str:
    entry = {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": [[4]], "op_id": seq,
             "process_group": ["0", "default_pg"], "profiling_name": f"gloo:{op}", "state": "scheduled",
             "time_created_ns": time.time_ns()}
    return json.dumps({"entries": [entry], "pg_config": {}, "pg_status": {}})


def _lines_until(stream, needle: str, deadline: float) -> list[str]:
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} on watch's stderr: {seen[-5:]}")


def test_watch_reads_a_dump_file_rewritten_while_it_watches(tmp_path: Path) -> None:
    holds = ("watch --fr FILE, the file rewritten after watch read it once: the new dump is read (within "
             "the 5 s dump poll) and the desync it shows is named; exit 3")
    with reported("watch --fr FILE: the dump rewritten while watch runs", holds, 1):
        me, host = os.getpid(), socket.gethostname()  # processes alive on this host: the run is live
        procs = [Proc(rank=r, world_size=2, pid=me, host=host, t0=time.time() - 1.0) for r in range(2)]
        for p in procs:
            _settings(p, stall_min_s=600.0)  # no hang while the test runs: only the desync
        declare(procs)
        seq = dp_steps(procs, range(3))
        open_op(procs[0], "all_reduce", "0", seq)  # rank 0 waits in all_reduce #seq
        logs = tmp_path / schema.STRUCTURED_LOGS_DIR
        logs.mkdir(parents=True)
        for p in procs:
            (logs / p.file_name).write_text("".join(line + "\n" for line in p.lines))
        dump = tmp_path / "rank_1.json"
        dump.write_text(_dump(seq - 1, "all_reduce"))  # what rank 1 issued last: agrees with rank 0
        cmd = [sys.executable, "-m", "otel_train.cli", "watch", str(tmp_path), "--json", "--fr", str(dump),
               "--exit-on", "desync", "--timeout", str(DEADLINE_S)]
        watcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _lines_until(watcher.stderr, "no dump for rank 0", time.monotonic() + DEADLINE_S)  # read once
            dump.write_text(_dump(seq, "broadcast"))  # rewritten: rank 1 issued a broadcast at #seq
            out, err = watcher.communicate(timeout=DEADLINE_S + 30)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.communicate()
        found = [json.loads(line)["finding"] for line in out.splitlines() if '"finding"' in line]
        assert watcher.returncode == 3, (watcher.returncode, out[-2000:], err[-2000:])
        assert [f["kind"] for f in found] == ["desync"] and found[0]["comm"]["seq"] == seq, found


TRAIN = textwrap.dedent(
    """
    import sys, time
    import otel_train as ot
    from otel_train import record_clock
    ot.init(save_path=sys.argv[1], enabled=True, stall_min_s=1.0, heartbeat_s=1.0)
    for step in range(10):
        with ot.training_step(step):
            with ot.log_trace_span("data_fetch"):
                time.sleep(0.01)
            with ot.log_trace_span("forward"):
                time.sleep(0.01)
                if step == 5:  # this span's end is stamped an hour ahead (the runtime clock, read once)
                    record_clock._OFFSET_NS += 3600 * 10**9
            if step == 5:
                record_clock._OFFSET_NS -= 3600 * 10**9
    with ot.training_step(10), ot.log_trace_span("data_fetch"):
        print("stuck", flush=True)
        while True:
            time.sleep(1)
    """
)


def test_a_record_from_the_future_does_not_hide_a_live_hang(tmp_path: Path) -> None:
    holds = ("a live process with one span end stamped +1 h, then stuck in data_fetch: watch --exit-on hang "
             "names hang rank 0 (exit 3); the record from the future is reported once on stderr")
    with reported("one span end an hour in the future, then a live hang", holds, 1):
        run = tmp_path / "run"
        child = subprocess.Popen([sys.executable, "-c", TRAIN, str(run)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "stuck"
            t0 = time.monotonic()
            watch = subprocess.run([sys.executable, "-m", "otel_train.cli", "watch", str(run), "--json",
                                    "--exit-on", "hang", "--timeout", str(DEADLINE_S)],
                                   capture_output=True, text=True, timeout=DEADLINE_S + 30)
            took = time.monotonic() - t0
        finally:
            child.kill()
            child.wait()
        found = [json.loads(line)["finding"] for line in watch.stdout.splitlines() if '"finding"' in line]
        assert watch.returncode == 3, (watch.returncode, took, watch.stdout[-2000:], watch.stderr[-2000:])
        hangs = [f for f in found if f["kind"] == "hang"]
        assert hangs and hangs[0]["rank"] == 0 and hangs[0]["phase"] == "data_fetch", found
        future = [line for line in watch.stderr.splitlines() if "ahead of" in line]
        assert len(future) == 1, watch.stderr[-2000:]
