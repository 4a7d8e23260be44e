"""A million distinct span names (an f-string with an id in it): what the process keeps per name is
bounded (issue 19, item 5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from faultlib import reported, trials

from otel_train import schema as S

SCRIPT = r"""
import json, sys
import otel_train as ot
from otel_train import runtime
from otel_train import watchdog as W
MAX_NAMES, OTHER_NAMES = getattr(W, "MAX_NAMES", 10**9), getattr(W, "OTHER_NAMES", "")

def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4

n = int(sys.argv[2])
ot.init(save_path=sys.argv[1], enabled=True, max_file_size_mb=1, backup_count=1)
dog = runtime._active.watchdog
dog.stop()  # this script looks itself (check), at known points: two lookers would race on the queue
for i in range(2000):  # warm up: the same name
    with ot.log_trace_span("warm"):
        pass
dog.check()
before = rss_kb()
for i in range(n):
    with ot.log_trace_span(f"load[{i}]"):
        pass
    if i % 4000 == 3999:
        dog.check()  # what the thread does once a second, at a known point
dog.check()
after = rss_kb()
names = dog.sketch.snapshot()
ot.shutdown()
print(json.dumps({"growth_kb": after - before, "names": len(names), "cap": MAX_NAMES,
                  "other": names.get(OTHER_NAMES, {}).get("count", 0)}))
"""


def test_distinct_span_names_hold_bounded_memory(tmp_path: Path) -> None:
    # make test: 60,000 names within 30 MB; make faults (FAULT_TRIALS): the target, 1,000,000 within 50 MB.
    n, bound_mb = (1_000_000, 50) if trials(1) > 1 else (60_000, 30)
    holds = (f"RSS growth <= {bound_mb} MB for {n:,} distinct names with the watchdog on (17.7 KB per name "
             "before); names past the cap are counted in one bucket, reported once on stderr, and the "
             "digest says so")
    with reported(f"{n:,} distinct span names, watchdog on", holds, 1):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(n)], capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.splitlines()[-1])
        print(f"{n} names: RSS growth {out['growth_kb'] / 1024:.1f} MB")
        assert out["growth_kb"] <= bound_mb * 1024, out
        assert out["names"] <= out["cap"] + 1, out
        assert out["other"] == n - (out["cap"] - 2), out  # the bucket and "warm" hold two slots of the cap
        assert proc.stderr.count("distinct span names") == 1, proc.stderr
        (digest,) = (tmp_path / S.DIGESTS_DIR).glob(f"*{S.DIGEST_SUFFIX}")
        phases = json.loads(digest.read_text())["phases"]
        assert len(phases) <= out["cap"] + 1
