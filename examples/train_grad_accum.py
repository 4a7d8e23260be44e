"""A third-party style DDP script with gradient accumulation, traced by hand (gloo on CPU).

    torchrun --standalone --nproc_per_node=2 examples/train_grad_accum.py --save-path runs/accum \\
        --slow-rank 1 --slow-ms 20
    otel-train summarize runs/accum

What a user who never read otel-train's integrations writes: ``ot.init``, ``ot.training_step`` and
``ot.log_trace_span`` around its own phases, nothing else. Each optimizer step runs ``--micro-steps``
micro-steps (data_fetch, forward, backward each); DDP's gradient all-reduce runs only in the last
micro-step's backward: ``model.require_backward_grad_sync`` is off before it and on for it, which is
what ``DistributedDataParallel.no_sync()`` does. So a rank slowed in ``data_fetch`` makes its peers
wait inside their last ``backward`` (the all-reduce): they are its victims, not stragglers.

``--instrument`` adds ``otel_train.torch.instrument(model)``: with ``collectives`` recording (the
default ``auto``) the all-reduces become ``comm.all_reduce`` spans. Without it (or with
``OTEL_TRAIN_COLLECTIVES=off``) the run has phase spans only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import otel_train as ot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-path", default="runs/accum")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-steps", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--batch-size", type=int, default=32, help="per micro-step and rank")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--slow-rank", type=int, help="this rank sleeps --slow-ms in every data_fetch")
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--instrument", action="store_true", help="otel_train.torch.instrument(model) too")
    p.add_argument("--slow-how", choices=("sleep", "spin"), default="sleep",
                   help="sleep (waiting on I/O) or spin (CPU-bound decoding) for --slow-ms")
    p.add_argument("--step-span", choices=("set_step", "training_step"), default="set_step",
                   help="ot.set_step per step (no step span), or ot.training_step (a step span)")
    p.add_argument("--fetch", choices=("micro", "step"), default="micro",
                   help="one data_fetch per micro-step, or one per step (split into micro-batches)")
    p.add_argument("--timeout-s", type=float, default=60.0)
    return p.parse_args(argv)


def slow(seconds: float, how: str) -> None:
    """The injected slowness: a sleep, or a busy loop on the CPU for as long."""
    if how == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ot.init(save_path=args.save_path, enabled=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, 8))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = None
    if args.instrument:
        from otel_train import torch as ott

        handle = ott.instrument(model)
    g = torch.Generator().manual_seed(rank)

    def fetch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        with ot.log_trace_span("data_fetch"):
            x = torch.randn(n, 32, generator=g)
            y = torch.randint(0, 8, (n,), generator=g)
            if rank == args.slow_rank:
                slow(args.slow_ms / 1000.0, args.slow_how)
        return x, y

    def one_step() -> None:
        if args.fetch == "step":
            xs, ys = fetch(args.batch_size * args.micro_steps)
        for micro in range(args.micro_steps):
            if args.fetch == "micro":
                x, y = fetch(args.batch_size)
            else:
                x, y = xs[micro::args.micro_steps], ys[micro::args.micro_steps]
            # Sync only on the last micro-step (what ``model.no_sync()`` does for the others).
            model.require_backward_grad_sync = micro == args.micro_steps - 1
            with ot.log_trace_span("forward", micro_step=micro):
                loss = nn.functional.cross_entropy(model(x), y) / args.micro_steps
            with ot.log_trace_span("backward", micro_step=micro):
                loss.backward()
        with ot.log_trace_span("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for step in range(args.steps):
        if args.step_span == "set_step":
            ot.set_step(step)
            one_step()
        else:
            with ot.training_step(step):
                one_step()
    if handle is not None:
        handle.remove()
    dist.destroy_process_group()
    ot.shutdown()
    if rank == 0:
        print(f"done: {args.steps} steps x {args.micro_steps} micro-steps, world {int(os.environ['WORLD_SIZE'])}")


if __name__ == "__main__":
    main()
    # DDP keeps gloo's process group, with its worker threads, alive past destroy_process_group; a
    # worker still letting go of its last op's tensors while the interpreter finalizes aborts the
    # process (torch's, with or without otel-train: docs/comm.md, "Exit").
    # Everything is written by now: leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
