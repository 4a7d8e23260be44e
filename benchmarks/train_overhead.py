"""Training overhead of otel-train: the same small loop untraced vs fully traced, in one process.

Blocks of steps alternate (untraced, traced, untraced, ...) so machine noise hits both alike. Traced
steps have every default phase span (step, data_fetch, batch_to_device, forward, backward, optimizer)
and batch statistics every step, written to real JSONL files. Prints a markdown table.

    .venv/bin/python benchmarks/train_overhead.py [--blocks 10 --steps-per-block 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import otel_train as ot
from otel_train import torch as ott

TARGET_PCT = 1.0


def build(hidden: int, batch: int, batches: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch * batches, 256)
    data = TensorDataset(x, torch.randint(0, 10, (batch * batches,)))
    return model, optimizer, DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def untraced_block(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterator[Any], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to("cpu"), y.to("cpu")
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def traced_block(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterator[Any], steps: int,
                 first_step: int) -> list[float]:
    times = []
    with ott.instrument(model, opt):
        for step in range(first_step, first_step + steps):
            t0 = time.perf_counter()
            with ot.training_step(step):
                batch = next(batches)
                x, y = ott.batch_to_device(batch, "cpu")
                loss = nn.functional.cross_entropy(model(x), y)
                ott.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    return times


Blocks = list[list[float]]


def interleaved(hidden: int, batch: int, blocks: int, steps: int) -> tuple[Blocks, Blocks]:
    """Per-step seconds, per block, of alternating untraced / traced blocks of the same model and data."""
    model, opt, loader = build(hidden, batch, batches=64)
    plain_batches = forever(loader)
    traced_batches = forever(ott.traced(loader))  # traced() re-iterates per epoch like a DataLoader
    untraced_block(model, opt, plain_batches, 10)  # warm-up: allocator, autograd, caches
    traced_block(model, opt, traced_batches, 10, first_step=0)
    plain: Blocks = []
    traced: Blocks = []
    for block in range(blocks):
        if block % 2 == 0:
            plain.append(untraced_block(model, opt, plain_batches, steps))
        else:
            traced.append(traced_block(model, opt, traced_batches, steps, first_step=10 + block * steps))
    return plain, traced


def median_step(blocks: Blocks) -> float:
    return statistics.median(t for block in blocks for t in block)


def quietest_block(blocks: Blocks) -> float:
    """Mean step of the least disturbed block: on a shared machine, other load only ever adds time."""
    return min(statistics.fmean(block) for block in blocks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=20, help="blocks in all, half of them traced")
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as run_dir:
        ot.init(save_path=run_dir, enabled=True, batch_stats_every=1)
        try:
            plain, traced = interleaved(args.hidden, args.batch, args.blocks, args.steps_per_block)
            # The same loop on a tiny model isolates the absolute tracing cost per step.
            tiny_plain, tiny_traced = interleaved(8, 4, args.blocks, args.steps_per_block * 10)
        finally:
            ot.shutdown()
    print("| loop | steps | median step (ms) | quietest block, mean step (ms) |\n|---|---|---|---|")
    for name, blocks in (("untraced", plain), ("traced (6 spans + batch stats / step)", traced),
                         ("tiny model, untraced", tiny_plain), ("tiny model, traced", tiny_traced)):
        steps = sum(len(b) for b in blocks)
        print(f"| {name} | {steps} | {median_step(blocks) * 1e3:.3f} | {quietest_block(blocks) * 1e3:.3f} |")
    base = median_step(plain)
    overhead_pct = (median_step(traced) / base - 1.0) * 100.0
    quiet_pct = (quietest_block(traced) / quietest_block(plain) - 1.0) * 100.0
    cost = quietest_block(tiny_traced) - quietest_block(tiny_plain)
    verdict = "met" if overhead_pct <= TARGET_PCT else "NOT met"
    print(f"\nmedian step-time overhead: {overhead_pct:+.2f}% (target <= {TARGET_PCT:.0f}%: {verdict}); "
          f"quietest blocks: {quiet_pct:+.2f}%")
    print(f"tracing cost per step (tiny model, quietest blocks): {cost * 1e6:.0f} µs = "
          f"{cost / base * 100:.2f}% of the {base * 1e3:.1f} ms median untraced step")


if __name__ == "__main__":
    main()
