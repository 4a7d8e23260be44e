"""The process around the tracing: its umask, the thread that calls ``init``, the kind of function a
decorator wraps.

What must hold: under ``umask 000`` nothing otel-train creates (run directory, ``structured_logs/``,
``digests/``, ``analysis/``, trace files and segments, digests, exports) is group- or world-writable;
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from faultlib import reported

UMASK_CHILD = textwrap.dedent(
    """
    import os, sys
    os.umask(0)
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, digest_s=0.05, max_file_size_mb=0.01, backup_count=2)
    for step in range(200):
        with ot.training_step(step), ot.log_trace_span("forward", pad="x" * 100):
            pass
    ot.shutdown(timeout_s=2.0)
    from otel_train.analysis.export import export
    export(sys.argv[1], "chrome")
    export(sys.argv[1], "perfetto", os.path.join(sys.argv[1], "new", "deeper", "trace.pftrace"))
    """
)


def test_umask_000_leaves_nothing_writable_by_others(tmp_path: Path) -> None:
    holds = ("under umask 000: run dir, structured_logs/, digests/, analysis/, an export's new parents 0755; trace "
             "file, rotated segments, digest, exports 0644; none group- or world-writable")
    with reported("umask 000 (run directory, digests, exports)", holds, 1):
        run = tmp_path / "deep" / "run"
        done = subprocess.run([sys.executable, "-c", UMASK_CHILD, str(run)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        made = [tmp_path / "deep", *run.parent.rglob("*")]
        kinds = {p.relative_to(tmp_path).parts[-1] for p in made}
        assert {"structured_logs", "digests", "analysis", "deeper"} <= kinds, sorted(kinds)
        assert any(p.name.endswith(".jsonl.1") for p in made) and any(p.name.endswith(".digest.json") for p in made)
        assert any(p.suffix == ".pftrace" for p in made) and any(p.suffix == ".json" and p.parent.name == "analysis"
                                                                   for p in made)
        modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode) for p in made}
        wrong = {k: oct(m) for k, m in modes.items()
                 if m != (0o755 if (tmp_path / k).is_dir() else 0o644)}
        assert wrong == {}, wrong
