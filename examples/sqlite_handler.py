"""A custom record handler: every otel-train record of this rank, streamed into a SQLite database.

Attach it without touching the training script (from the repository root, so ``examples`` imports)::

    PYTHONPATH=. OTEL_TRAIN_HANDLERS=examples.sqlite_handler:sqlite_records python examples/train_ddp.py

or in code: ``ot.init(save_path, enabled=True, handlers=[sqlite_records])``. Each rank writes
``<save_path>/structured_logs/records.rank<rank>.sqlite`` (table ``records``), next to its JSONL file.

Run this file to trace a short loop and query the database::

    python examples/sqlite_handler.py runs/sqlite-demo
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import otel_train as ot
from otel_train import phases
from otel_train import schema as S

TABLE = "records"
# One column per field worth filtering on; the whole record is kept as JSON beside them.
COLUMNS = (S.TS, S.KIND, S.NAME, S.STEP, S.RANK, S.SPAN_ID, S.PARENT_SPAN_ID, S.DUR_MS, S.STATUS)
CREATE = (f"CREATE TABLE IF NOT EXISTS {TABLE} (ts REAL, kind TEXT, name TEXT, step INTEGER, rank INTEGER, "
          "span_id TEXT, parent_span_id TEXT, dur_ms REAL, status TEXT, record TEXT NOT NULL)")
INSERT = f"INSERT INTO {TABLE} VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"


def database_path(log_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where :func:`sqlite_records` puts rank ``rank``'s database."""
    return Path(log_dir) / f"records.rank{rank}.sqlite"


class SqliteRecordHandler:
    """Buffers records and commits them to SQLite every ``batch_size`` records or ``max_delay_s`` seconds.

    ``on_record`` runs on the training thread, so it only appends to a list until a batch is due; the
    JSONL file stays the crash-safe copy (a killed process loses at most the uncommitted batch here).
    """

    def __init__(self, path: str | os.PathLike[str], *, batch_size: int = 256, max_delay_s: float = 1.0) -> None:
        self.path = Path(path)
        self._batch_size = batch_size
        self._max_delay_s = max_delay_s
        # Records arrive from whichever thread ended a span; one lock guards the buffer and connection.
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(CREATE)
        self._conn.commit()
        self._pending: list[tuple[Any, ...]] = []
        self._last_commit = time.monotonic()

    def on_record(self, record: dict) -> None:
        """Queue one schema-v1 record; commit when the batch is full or old enough."""
        row = tuple(record.get(column) for column in COLUMNS) + (json.dumps(record, separators=(",", ":")),)
        with self._lock:
            if self._conn is None:
                return
            self._pending.append(row)
            if len(self._pending) >= self._batch_size or time.monotonic() - self._last_commit >= self._max_delay_s:
                self._commit()

    def shutdown(self) -> None:
        """Commit what is left and close the database (idempotent)."""
        with self._lock:
            if self._conn is None:
                return
            self._commit()
            self._conn.close()
            self._conn = None

    def _commit(self) -> None:
        self._conn.executemany(INSERT, self._pending)
        self._conn.commit()
        self._pending.clear()
        self._last_commit = time.monotonic()


def sqlite_records(*, log_dir: str, rank: int, **_: Any) -> SqliteRecordHandler:
    """Handler factory: ``OTEL_TRAIN_HANDLERS=examples.sqlite_handler:sqlite_records``."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return SqliteRecordHandler(database_path(log_dir, rank))


PHASE_QUERY = (f"SELECT name, COUNT(*), AVG(dur_ms), MAX(dur_ms) FROM {TABLE} "
               f"WHERE kind = '{S.SPAN_END}' GROUP BY name ORDER BY name")


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def _traced_loop(steps: int) -> None:
    for step in range(steps):
        with ot.training_step(step, epoch=0):
            with ot.log_trace_span(phases.DATA_FETCH):
                _busy(2_000)
            with ot.log_trace_span(phases.FORWARD, batch=step):
                _busy(20_000)
            with ot.log_trace_span(phases.BACKWARD):
                _busy(30_000)
            with ot.log_trace_span(phases.OPTIMIZER):
                _busy(5_000)
            ot.log_trace_scalar({"loss": 1.0 / (step + 1)})


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/sqlite_handler.py RUN_DIR", file=sys.stderr)
        return 2
    save_path = Path(argv[0])
    ot.init(save_path, enabled=True, handlers=[sqlite_records])
    try:
        _traced_loop(steps=20)
    finally:
        ot.shutdown()
    db = database_path(save_path / S.STRUCTURED_LOGS_DIR, 0)
    with sqlite3.connect(db) as conn:
        total = conn.execute(f"SELECT COUNT(*) FROM {TABLE}").fetchone()[0]
        rows = conn.execute(PHASE_QUERY).fetchall()
    print(f"{db}: {total} records")
    print(f"{'phase':<12} {'count':>5} {'mean_ms':>9} {'max_ms':>9}")
    for name, count, mean_ms, max_ms in rows:
        print(f"{name:<12} {count:>5} {mean_ms:>9.3f} {max_ms:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
