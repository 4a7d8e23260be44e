"""Run ``examples/train_ddp.py`` as one rank of a job whose ranks play two hosts with clocks of their
own (tests/test_clock_torchrun.py): ranks ``rank // 2`` = 0 and 1 are hosts ``host-a`` and ``host-b``;
``CLOCK_FAKE_A`` / ``CLOCK_FAKE_B`` (libfaketime's ``FAKETIME``, e.g. ``+5s``, ``-5s x1.0001``) set
each host's clock, preloaded through ``LD_PRELOAD`` before the rank's interpreter starts.

    torchrun --nproc_per_node=4 tests/faketime_launch.py --save-path ... [train_ddp.py options]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    host = "ab"[min(rank // 2, 1)]
    env = dict(os.environ)
    env["OTEL_TRAIN_HOST"] = f"host-{host}"
    fake = os.environ.get(f"CLOCK_FAKE_{host.upper()}", "")
    if fake:
        env["LD_PRELOAD"] = LIB
        env["FAKETIME"] = fake
        env["FAKETIME_NO_CACHE"] = "1"  # read FAKETIME once per call, not cached: no jumps
    os.execve(sys.executable, [sys.executable, str(SCRIPT), *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
