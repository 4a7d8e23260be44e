"""The cost of a span through ``otel_train.titan.register_handler`` (issue 44's second target).

Times one span (enter + exit, nothing inside) four ways, each in a fresh process (their logger is
initialised once per process), with torchtitan installed:

* ``titan jsonl``: their ``log_trace_span`` with their default JSONL factory (what torchtitan costs now);
* ``titan, null handler``: their ``log_trace_span`` with a handler that does nothing (their logging
  call alone: the record made and dispatched);
* ``otel-train``: ``otel_train.log_trace_span`` alone (``ot.init``, JSONL sink);
* ``titan -> otel-train``: their ``log_trace_span`` with only our factory;
* ``both``: their ``log_trace_span`` with both factories (their JSONL kept).

Prints a markdown table of µs per span (the median of ``--repeat`` rounds of ``--spans`` spans).

    .venv/bin/python benchmarks/titan_handler.py [--spans N] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

_JSONL = "torchtitan.observability.structured_logger.jsonl_handler.register_jsonl_handler"
_OURS = "otel_train.titan.register_handler"
_NULL = "titan_handler.register_null"


def register_null(*, structured_logger: logging.Logger, **_: object) -> None:
    """A factory whose handler does nothing: their logging call's own cost."""
    structured_logger.addHandler(logging.NullHandler())

_CHILD = """
import json, os, statistics, sys, time
mode, spans, repeat, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "ours":
    import otel_train as ot
    ot.init(save_path=out, enabled=True)
    span = ot.log_trace_span
else:
    import torchtitan.observability.structured_logger as sl
    sl.init_structured_logger(source="training", output_dir=out, rank=0)
    sl.set_step(1)
    span = sl.log_trace_span
rounds = []
for _ in range(repeat):
    t0 = time.perf_counter()
    for _ in range(spans):
        with span("fwd_bwd"):
            pass
    rounds.append((time.perf_counter() - t0) / spans * 1e6)
print(json.dumps(rounds))
"""


def run(mode: str, handlers: str | None, spans: int, repeat: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_TRAIN_", "TITAN_STRUCT"))}
    if handlers is not None:
        env["TITAN_STRUCT_LOGGER_HANDLERS"] = handlers
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(spans), str(repeat), out], env=env,
                              check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = [("titan jsonl", "titan", _JSONL), ("titan, null handler", "titan", _NULL), ("otel-train", "ours", None),
            ("titan -> otel-train", "titan", _OURS), ("both", "titan", f"{_JSONL},{_OURS}")]
    print(f"µs per span (enter + exit), median (range) of {args.repeat} rounds of {args.spans:,}\n")
    print("| way | µs/span |")
    print("|---|---:|")
    for label, mode, handlers in rows:
        got = sorted(run(mode, handlers, args.spans, args.repeat))
        print(f"| {label} | {got[len(got) // 2]:.1f} ({got[0]:.1f} – {got[-1]:.1f}) |")


if __name__ == "__main__":
    main()
