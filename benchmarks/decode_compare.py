"""Readers side by side on the analysis benchmark's run: what feeds the span model fastest?

Each row runs in a fresh process (process to process), rounds interleaved, beside the four-column
DuckDB query of benchmarks/analysis_throughput.py:

* ``duckdb-query``: the expert's query (four columns, group-by quantiles);
* ``msgspec-structs``: today's decode into the record Structs, every process in turn (no span model);
* ``msgspec-narrow``: field-selective decode into a Struct of only what summaries need;
* ``duckdb-columns``: DuckDB's multi-threaded read_json of the span model's columns into numpy;
* ``polars-columns`` / ``pyarrow-columns``: polars' and pyarrow's multi-threaded NDJSON readers of the
  same columns (every file of the run into one frame / table);
* ``load_run-serial`` / ``load_run-pool``: decode and span model, one process or the pool;
* ``load_run-cached``: the second read (the read cache beside the run).

    .venv/bin/python benchmarks/decode_compare.py [--rounds 3] [--busy]

``--busy`` keeps one core busy (a spinning process) throughout. polars and pyarrow are not dependencies
of otel-train: their rows run where they are installed (``pip install polars pyarrow`` into the venv
for the measurement) and are left out otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN = Path("/tmp/otel-train-bench/run-16x4000-sync")  # analysis_throughput.generate(..., 16, 4000)

CASES = {
    "duckdb-query": """
import duckdb, sys
sys.path.insert(0, 'benchmarks')
from analysis_throughput import duckdb_query
duckdb_query(RUN)
""",
    "msgspec-structs": """
from otel_train.analysis.records import Reader, find_process_files
r = Reader()
n = sum(len(b) for pf in find_process_files(RUN) for b in r.batches(pf))
""",
    "msgspec-narrow": """
import msgspec
from otel_train.analysis.records import find_process_files
class R(msgspec.Struct, gc=False):
    kind: str = ""
    name: str = ""
    span_id: str | None = None
    step: int | None = None
    ts: float = 0.0
    dur_ms: float | None = None
    status: str | None = None
dec = msgspec.json.Decoder(R)
n = 0
for pf in find_process_files(RUN):
    for p in pf.paths:
        with open(p, 'rb') as f:
            carry = b''
            while block := f.read(1 << 20):
                block = carry + block
                cut = block.rfind(b'\\n') + 1
                n += len(dec.decode_lines(block[:cut]))
                carry = block[cut:]
""",
    "duckdb-columns": """
import duckdb
glob = str(RUN / 'structured_logs' / '*.jsonl*')
cols = {'kind': 'VARCHAR', 'name': 'VARCHAR', 'span_id': 'VARCHAR', 'rank': 'INTEGER', 'step': 'BIGINT',
        'ts': 'DOUBLE', 'dur_ms': 'DOUBLE', 'status': 'VARCHAR'}
spec = ', '.join(f"{k}: '{v}'" for k, v in cols.items())
con = duckdb.connect()
out = con.execute(f"SELECT * FROM read_json('{glob}', format='newline_delimited', ignore_errors=true, "
                  f"columns={{{spec}}})").fetchnumpy()
""",
    "polars-columns": """
import polars as pl
schema = {'kind': pl.Utf8, 'name': pl.Utf8, 'span_id': pl.Utf8, 'rank': pl.Int32, 'step': pl.Int64,
          'ts': pl.Float64, 'dur_ms': pl.Float64, 'status': pl.Utf8}
paths = [str(p) for p in sorted((RUN / 'structured_logs').glob('*.jsonl*'))]
out = pl.concat([pl.read_ndjson(p, schema=schema, ignore_errors=True) for p in paths])
""",
    "pyarrow-columns": """
import pyarrow as pa, pyarrow.json as pj
schema = pa.schema([('kind', pa.string()), ('name', pa.string()), ('span_id', pa.string()),
                    ('rank', pa.int32()), ('step', pa.int64()), ('ts', pa.float64()),
                    ('dur_ms', pa.float64()), ('status', pa.string())])
opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior='ignore')
paths = sorted((RUN / 'structured_logs').glob('*.jsonl*'))
out = pa.concat_tables([pj.read_json(p, parse_options=opts) for p in paths])
""",
    "load_run-serial": "from otel_train.analysis.spans import load_run\nload_run(RUN, workers=1, cache=False)\n",
    "load_run-pool": "from otel_train.analysis.spans import load_run\nload_run(RUN, cache=False)\n",
    "load_run-cached": "from otel_train.analysis.spans import load_run\nload_run(RUN)\n",
}

TIMER = """
import time
from pathlib import Path
RUN = Path({run!r})
t0 = time.perf_counter()
{body}
print(time.perf_counter() - t0)
"""


OPTIONAL = {"polars-columns": "polars", "pyarrow-columns": "pyarrow"}
"""Rows whose reader is not a dependency: run only where that module is installed."""


def installed(name: str) -> bool:
    module = OPTIONAL.get(name)
    return module is None or importlib.util.find_spec(module) is not None


def once(name: str, run: Path) -> float:
    code = TIMER.format(run=str(run), body=CASES[name])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    parser.add_argument("--run", type=Path, default=RUN)
    args = parser.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        once("load_run-cached", args.run)  # fill the cache (and the page cache)
        times: dict[str, list[float]] = {k: [] for k in CASES if installed(k)}
        for _ in range(args.rounds):
            for name in times:
                times[name].append(once(name, args.run))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    load = os.getloadavg()[0]
    print(f"| reader ({'one core busy' if args.busy else 'no extra load'}, load {load:.1f}) | s (median, range) | × DuckDB query |")
    print("|---|---:|---:|")
    duck = statistics.median(times["duckdb-query"])
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} ({min(ts):.2f} – {max(ts):.2f}) | {statistics.median(ts) / duck:.2f} |")
    for name in CASES:
        if name not in times:
            print(f"| {name} | not installed ({OPTIONAL[name]}) | |")


if __name__ == "__main__":
    main()
