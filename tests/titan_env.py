"""Where the tests find torchtitan: ``.venv-titan`` (made by ``make test``, .ci/titan-venv.sh), else the
interpreter running the tests when it has torchtitan itself (a user's own venv).

torchtitan 0.3.0 needs ``datasets < 4.8`` and so ``huggingface-hub < 2``; the transformers the suite's own
venv tests needs ``huggingface-hub >= 2.4``. So torchtitan's side of these tests (its trainer, its logger)
runs in processes of the torchtitan venv, and the analysis of their files in the test's own process.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-titan"
PROBE = "import torchtitan.observability.structured_logger, tokenizers, otel_train.titan"
MISSING = ("torchtitan is not installed: `make test` puts it in .venv-titan (.ci/titan-venv.sh; "
           "run that script to see why it failed), or pip install torchtitan==0.3.0 torch==2.13.0")


@functools.cache
def python() -> Path | None:
    """The interpreter that has torchtitan, or None (the tests then skip with :data:`MISSING`)."""
    for candidate in (VENV / "bin" / "python", Path(sys.executable)):
        if candidate.exists() and subprocess.run([str(candidate), "-c", PROBE], capture_output=True, cwd="/",
                                                 timeout=120).returncode == 0:  # from /: not by the cwd
            return candidate
    return None


def torchrun() -> Path | None:
    """torchrun beside :func:`python`."""
    found = python()
    return None if found is None else found.with_name("torchrun")
