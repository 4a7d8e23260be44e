"""Ask a running job's ranks for a profiler window through a file (docs/profiling.md, "From watch").

``python -m otel_train.profiling.request RUN`` reads a ``watch`` finding's JSON on stdin (what
``otel-train watch RUN --on-finding CMD`` gives CMD) and, for a ``straggler`` finding, writes
``RUN/profiles/requests/rank_<r>`` holding the reason. A process with ``profile_on`` set looks for its
file once a second on the watchdog's thread; finding it, it removes it and opens a window of
``profile_window`` steps at its next step change, as if its own check had fired (the same bounds:
never two at once, at most ``profile_max_windows``). ``--rank R --reason straggler|slow_step``
writes a request without a finding. Imports nothing of the runtime or of torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

REQUESTS_DIR = os.path.join("profiles", "requests")
REASONS = ("straggler", "slow_step")
MAX_REQUEST_BYTES = 256


def request_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, REQUESTS_DIR, f"rank_{rank}")


def write_request(run_dir: str, rank: int, reason: str) -> str:
    """Write the request file for ``rank`` (through a temporary name); its path."""
    if reason not in REASONS:
        raise ValueError(f"reason {reason!r}: use one of {', '.join(REASONS)}")
    path = request_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(reason)
    os.replace(tmp, path)
    return path


def take_request(run_dir: str, rank: int) -> str | None:
    """The reason of this rank's request, removing the file; None when there is none (or it is not one)."""
    path = request_path(run_dir, rank)
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_REQUEST_BYTES).decode("ascii", "replace").strip()
        os.unlink(path)
    except OSError:
        return None
    return text if text in REASONS else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otel_train.profiling.request", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the run directory (the job's save_path)")
    parser.add_argument("--rank", type=int, help="ask this rank (default: the finding's, read from stdin)")
    parser.add_argument("--reason", choices=REASONS, default="straggler")
    args = parser.parse_args(argv)
    rank, reason = args.rank, args.reason
    if rank is None:
        finding: Any = json.loads(sys.stdin.read() or "{}")
        if not isinstance(finding, dict) or finding.get("kind") != "straggler" or not isinstance(finding.get("rank"), int):
            return 0  # not a straggler finding: nothing to ask
        rank = finding["rank"]
    print(f"asked rank {rank} for a profiler window: {write_request(args.run, rank, reason)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
