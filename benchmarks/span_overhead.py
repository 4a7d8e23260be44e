"""Per-span cost of otel-train against the bare OTel SDK and the logging-handler JSONL writers it replaces.

One run, all variants interleaved (round-robin blocks), median of repeats; prints µs/span and ratios
as a markdown table. Usage: ``python benchmarks/span_overhead.py [--spans N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

from opentelemetry.sdk.trace import TracerProvider

import otel_train as ot


def bare_otel() -> Callable[[int], None]:
    """The OTel SDK span everyone uses: start_as_current_span, no processor."""
    tracer = TracerProvider().get_tracer("bench")

    def run(n: int) -> None:
        for _ in range(n):
            with tracer.start_as_current_span("forward"):
                pass

    return run


def otel_train_spans(n: int) -> None:
    """The loop both otel-train variants time; what it costs depends on whether tracing is on."""
    span = ot.log_trace_span
    for _ in range(n):
        with span("forward"):
            pass


def otel_train_enabled(save_dir: str) -> Callable[[int], None]:
    """otel-train: JSONL start + end records with step context, one os.write each."""
    ot.init(save_path=save_dir, enabled=True, max_file_size_mb=64, backup_count=1)
    ot.set_step(1, epoch=0)
    return otel_train_spans


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"ts": record.created, "level": record.levelname, **record.__dict__["payload"]})


def logging_handler(save_dir: str) -> Callable[[int], None]:
    """The torchtitan/pimm style: a stdlib logging FileHandler + JSON formatter, flushed per record."""
    logger = logging.getLogger("bench.structured")
    logger.propagate = False
    handler = logging.FileHandler(os.path.join(save_dir, "logging.jsonl"))
    handler.setFormatter(_JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    base = {"rank": 0, "world_size": 1, "host": "h", "pid": os.getpid(), "step": 1}

    def run(n: int) -> None:
        for _ in range(n):
            start = time.time()
            logger.info("forward_start", extra={"payload": {**base, "event": "forward_start"}})
            logger.info("forward_end", extra={"payload": {**base, "event": "forward_end",
                                                          "dur_ms": (time.time() - start) * 1e3}})
            # FileHandler flushes after every emit (StreamHandler.flush), like the tools we replace.

    return run


def blog_helper(save_dir: str) -> Callable[[int], None]:
    """The blog-style helper: json.dumps + write + flush per record."""
    fh = open(os.path.join(save_dir, "blog.jsonl"), "a")
    base = {"rank": 0, "world_size": 1, "host": "h", "pid": os.getpid(), "step": 1}

    def log(event: str, **fields: object) -> None:
        fh.write(json.dumps({"ts": time.time(), "event": event, **base, **fields}) + "\n")
        fh.flush()

    def run(n: int) -> None:
        for _ in range(n):
            start = time.time()
            log("forward_start")
            log("forward_end", dur_ms=(time.time() - start) * 1e3)

    return run


def measure(variants: dict[str, Callable[[int], None]], spans: int, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run(min(spans, 2000))  # warm up
    for _ in range(repeats):
        for name, run in variants.items():
            t0 = time.perf_counter()
            run(spans)
            samples[name].append((time.perf_counter() - t0) / spans * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spans", type=int, default=20000, help="spans per block")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved blocks per variant")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # Disabled is measured first, on its own: enabling is process-wide.
        disabled = measure({"disabled": otel_train_spans}, args.spans * 5, args.repeats)["disabled"]
        variants = {
            "bare OTel SDK span (start_as_current_span, no processor)": bare_otel(),
            "otel-train span (JSONL start+end, step context)": otel_train_enabled(tmp),
            "logging.FileHandler + JSON formatter, flush per record": logging_handler(tmp),
            "blog-style json.dumps + write + flush": blog_helper(tmp),
        }
        result = measure(variants, args.spans, args.repeats)
        ot.shutdown()
    bare = result["bare OTel SDK span (start_as_current_span, no processor)"]
    ours = result["otel-train span (JSONL start+end, step context)"]
    print(f"python {sys.version.split()[0]}, {args.repeats} interleaved blocks of {args.spans} spans, median\n")
    print("| variant | µs/span | vs bare OTel | otel-train faster by |")
    print("|---|---:|---:|---:|")
    for name, us in result.items():
        print(f"| {name} | {us:.2f} | {us / bare:.2f}× | {us / ours:.2f}× |")
    print(f"| otel-train disabled (no-op) | {disabled:.3f} | — | — |")
    print(f"\ntargets: otel-train ≤ 1.3× bare OTel: {ours / bare:.2f}×; "
          f"≥ 3× faster than the logging handler: "
          f"{result['logging.FileHandler + JSON formatter, flush per record'] / ours:.2f}×; "
          f"disabled ≤ 0.3 µs: {disabled:.3f} µs")


if __name__ == "__main__":
    main()
