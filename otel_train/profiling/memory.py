"""``memory_snapshot=on_oom``: CUDA allocation history, dumped when an OOM passes through a traced span.

Where CUDA is available, :func:`install` starts ``torch.cuda.memory._record_memory_history`` and
returns a listener for :data:`otel_train.api.error_listeners`: when a ``torch.OutOfMemoryError`` (or
any exception whose message says "out of memory") ends a traced span, the snapshot is written once
to ``<run>/profiles/rank_<r>/oom.step_<s>.pickle`` (PyTorch's memory visualiser reads it).
On CPU (no CUDA) it does nothing at all: no history, no listener, no file (docs/profiling.md).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from otel_train import _report
from otel_train import context as step_context
import otel_train.profiling.output as output

MAX_ENTRIES = 100_000


def install(run_dir: str, rank: int) -> Callable[[BaseException], None] | None:
    """Start recording and return the OOM listener; None where CUDA is not available (a no-op)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
    done: list[str] = []

    def on_error(exc: BaseException) -> None:
        if done or not _is_oom(exc):
            return
        step = step_context.current_step()
        rel = output.relative_path(rank, f"oom.step_{step}.pickle")
        path = os.path.join(run_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        done.append(rel)
        _report.report("memory snapshot", f"an out-of-memory error passed through a traced span: {rel}")

    return on_error


def _is_oom(exc: Any) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()
