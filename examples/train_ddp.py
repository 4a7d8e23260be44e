"""A small DDP training run, fully traced, with injectable faults (slow rank, hang, exception).

    torchrun --standalone --nproc_per_node=4 examples/train_ddp.py --save-path runs/demo
    otel-train summarize runs/demo

Faults (all off by default):
    --slow-rank 2 --slow-phase data_fetch --slow-ms 200    rank 2 is 200 ms slower in that phase
    --slow-from 20                                         ... only from step 20 on
    --hang-rank 1 --hang-step 12 --hang-phase forward      rank 1 sleeps forever in forward at step 12;
                                                          peers block in the next collective until the
                                                          --timeout-s collective timeout ends the run
    --hang-how regex                                       ... stuck in a regular expression that holds
                                                          the GIL instead (kill: SIGKILL itself there)
    --fail-rank 3 --fail-step 8                            rank 3 raises in forward at step 8
    --fail-attempts 1                                      ... only in the first torchrun attempt, so
                                                          --max-restarts=1 recovers (with --resume
                                                          from the last checkpoint)

Communication faults (docs/comm.md). Each needs the per-step metric all-reduce, a `comm.all_reduce`
in a group of its own (desc `metrics`), which any --fault turns on (--metrics alone also does):
    --fault skip-collective --fault-rank 1 --fault-step 3  rank 1 skips the metric all-reduce of step 3:
                                                          its peers wait in it, rank 1 waits in the
                                                          next step's DDP all-reduce, until --timeout-s
    --fault desync-op --fault-rank 1 --fault-step 3        rank 1 calls broadcast where the others call
                                                          all_reduce
    --fault desync-size --fault-rank 1 --fault-step 3      rank 1 all-reduces a tensor of another size
    --fault slow-stage --fault-rank 1 --slow-ms 100        rank 1 is 100 ms slower in forward every step:
                                                          the last to arrive at every collective

Live: --watch starts `otel-train watch` beside the job (on rank 0), which names the culprit rank,
step and phase within seconds of a stall (see README "Live"); OTEL_TRAIN_STALL_MIN_S=3 makes that
3 s instead of 10 s on this small model.

Uses gloo on CPU and nccl (one GPU per local rank) when CUDA is available.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import otel_train as ot
from otel_train import phases
from otel_train import torch as ott

log = logging.getLogger("train_ddp")

COMM_FAULTS = ("skip-collective", "desync-op", "desync-size", "slow-stage")
FAULT_PHASES = (phases.DATA_FETCH, phases.FORWARD, phases.BACKWARD, phases.OPTIMIZER, phases.CHECKPOINT, phases.EVAL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-path", default="runs/demo", help="run directory (trace files, checkpoints)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--checkpoint-every", type=int, default=10, help="0: never")
    p.add_argument("--eval-every", type=int, default=15, help="0: only at the end")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--timeout-s", type=float, default=30.0, help="collective timeout (ends a hang)")
    p.add_argument("--no-trace", action="store_true", help="run without otel-train")
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-phase", choices=FAULT_PHASES, default=phases.DATA_FETCH)
    p.add_argument("--slow-ms", type=float, default=200.0)
    p.add_argument("--slow-from", type=int, help="--slow-rank is slow from this step on (default: always)")
    p.add_argument("--hang-rank", type=int)
    p.add_argument("--hang-step", type=int, default=10)
    p.add_argument("--hang-phase", choices=FAULT_PHASES, default=phases.FORWARD)
    p.add_argument("--hang-how", choices=("sleep", "regex", "kill"), default="sleep",
                   help="sleep forever, backtrack in a regular expression holding the GIL, or SIGKILL itself")
    p.add_argument("--watch", action="store_true", help="run `otel-train watch` beside the job (rank 0 starts it)")
    p.add_argument("--fail-rank", type=int)
    p.add_argument("--fail-step", type=int, default=5)
    p.add_argument("--fail-attempts", type=int, help="fail only in the first N restart attempts (default: all)")
    p.add_argument("--resume", action="store_true", help="start after the step of the last checkpoint, if any")
    p.add_argument("--fault", choices=COMM_FAULTS, help="a communication fault (see above)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--metrics", action="store_true", help="all-reduce the loss in a 'metrics' group every step")
    p.add_argument("--fr-dump-after", type=float, metavar="S",
                   help="S seconds after --fault-step begins, every rank writes its Flight Recorder buffer "
                        "(torch's _dump_fr_trace pickle) to <save-path>/flight_recorder/dump.rank_<rank>.pkl")
    p.add_argument("--gpu-wait-ms", type=float, default=0.0,
                   help="every rank also waits this long in forward without using the CPU, as a step waits on a "
                        "GPU: keeps step times steady on a busy CPU (tests and benchmarks)")
    p.add_argument("--cpu-wait", action="store_true",
                   help="log each step's wait for a CPU as the scalar cpu_wait_ms: how long the kernel kept the "
                        "training thread runnable but off every CPU (Linux schedstat; tests judge stragglers by it)")
    return p.parse_args(argv)


def cpu_wait_ms() -> float:
    """The calling thread's time runnable but not running since it started (schedstat's run delay), in ms;
    NaN where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return float("nan")


class Faults:
    """Where and when this rank misbehaves; ``inject(phase)`` runs inside that phase's span."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args = args
        self.rank = rank
        self.step = -1
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def active(self, phase: str) -> bool:
        """Whether any fault targets ``phase`` on this rank (no hooks or checks otherwise)."""
        a = self.args
        if a.fault == "slow-stage" and a.fault_rank == self.rank and phase == phases.FORWARD:
            return True
        return (a.slow_rank == self.rank and a.slow_phase == phase) or (
            a.hang_rank == self.rank and a.hang_phase == phase
        ) or (a.fail_rank == self.rank and phase == phases.FORWARD)

    def inject(self, phase: str) -> None:
        a = self.args
        if a.slow_rank == self.rank and a.slow_phase == phase and (a.slow_from is None or self.step >= a.slow_from):
            time.sleep(a.slow_ms / 1000.0)
        if a.fault == "slow-stage" and a.fault_rank == self.rank and phase == phases.FORWARD:
            time.sleep(a.slow_ms / 1000.0)
        if a.hang_rank == self.rank and a.hang_step == self.step and a.hang_phase == phase:
            hang(a.hang_how, self.rank, phase, self.step)
        if a.fail_rank == self.rank and a.fail_step == self.step and phase == phases.FORWARD and (
            a.fail_attempts is None or self.attempt < a.fail_attempts
        ):
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


def all_reduce_metrics(loss: torch.Tensor, group: Any, faults: Faults) -> None:
    """The per-step metric all-reduce (a ``comm.all_reduce`` of 4 floats in the ``metrics`` group),
    where the communication faults strike."""
    a = faults.args
    here = a.fault_rank == faults.rank and a.fault_step == faults.step
    metrics = torch.stack([loss.detach(), loss.detach() * 0 + 1, loss.detach() * 0, loss.detach() * 0])
    if here and a.fault == "skip-collective":
        log.warning("injected fault: rank %d skips the metric all_reduce at step %d", faults.rank, faults.step)
        return
    if here and a.fault == "desync-op":
        log.warning("injected fault: rank %d broadcasts where its peers all_reduce (step %d)", faults.rank, faults.step)
        dist.broadcast(metrics, src=0, group=group)
        return
    if here and a.fault == "desync-size":
        log.warning("injected fault: rank %d all_reduces 2 floats, its peers 4 (step %d)", faults.rank, faults.step)
        metrics = metrics[:2].contiguous()
    dist.all_reduce(metrics, group=group)


def hang(how: str, rank: int, phase: str, step: int) -> None:
    """Never return: sleep (the GIL stays free), a regular expression (C code holding the GIL for hours:
    not even the watchdog thread runs), or die by SIGKILL inside the span, 0.2 s into it, as a process
    killed while it works (a kill at the very instant a phase starts may find the previous phase open on
    disk: the trace writer's thread had not run yet; docs/runtime.md, "What a SIGKILL can lose")."""
    log.warning("injected hang (%s): rank %d in %s at step %d", how, rank, phase, step)
    if how == "kill":
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "regex":
        re.match(r"(a+)+$", "a" * 64 + "b")  # 2**64 backtracking steps
    while True:
        time.sleep(3600)


def start_watch(save_path: str) -> subprocess.Popen[bytes]:
    """`otel-train watch SAVE_PATH --stacks` in a session of its own: the launcher's signals to the
    workers don't reach it, and it ends by itself once every rank has ended."""
    cmd = [sys.executable, "-m", "otel_train.cli", "watch", save_path, "--stacks"]
    return subprocess.Popen(cmd, start_new_session=True)


class Net(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, faults: Faults) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )
        self.faults = faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.faults.args.gpu_wait_ms:
            time.sleep(self.faults.args.gpu_wait_ms / 1000.0)
        if self.faults.active(phases.FORWARD):
            self.faults.inject(phases.FORWARD)
        out = self.body(x)
        if out.requires_grad and self.faults.active(phases.BACKWARD):  # runs inside the backward span
            out.register_hook(lambda grad: self.faults.inject(phases.BACKWARD))
        return out


class FaultyIterable:
    """Wraps the loader so a data_fetch fault happens inside the fetch (inside traced()'s span)."""

    def __init__(self, loader: DataLoader, faults: Faults) -> None:
        self.loader = loader
        self.faults = faults

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.faults.inject(phases.DATA_FETCH)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


def synthetic_data(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def evaluate(model: nn.Module, data: TensorDataset, device: torch.device, faults: Faults) -> float:
    with ot.log_trace_span(phases.EVAL):
        faults.inject(phases.EVAL)
        model.eval()
        with torch.no_grad():
            x, y = (t.to(device) for t in data.tensors)
            loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
            totals = torch.stack([loss, torch.tensor(float(len(y)), device=device)])
            dist.all_reduce(totals)
        model.train()
        mean = (totals[0] / totals[1]).item()  # an explicit sync, fine once per eval
    ot.log_trace_scalar({"eval_loss": mean})
    return mean


def save_checkpoint(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, path: Path, rank: int,
                    faults: Faults, step: int) -> None:
    with ot.log_trace_span(phases.CHECKPOINT):
        ot.add_step_tag("checkpoint")
        faults.inject(phases.CHECKPOINT)
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)
            log.info("saved checkpoint %s", path)
        dist.barrier()


def init_distributed(backend: str, timeout: datetime.timedelta) -> None:
    """``init_process_group``; a torchrun restart attempt gets its own key prefix in the agent's store.

    torchrun keeps one store across restarts, so without a prefix gloo would read the previous
    attempt's (dead) peer addresses and fail to connect.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def fr_dump_later(after_s: float, folder: Path, rank: int) -> None:
    """A daemon timer that writes this rank's Flight Recorder buffer (what a hung job's operator would
    take with torch's own tools), to read a fault from the dumps alone (docs/comm.md)."""
    def dump() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        data = torch._C._distributed_c10d._dump_fr_trace()
        (folder / f"dump.rank_{rank}.pkl").write_bytes(data)

    timer = threading.Timer(after_s, dump)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank_label = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank_label} %(levelname)s %(message)s")
    watcher = start_watch(args.save_path) if args.watch and rank_label == "0" else None
    if not args.no_trace:
        # Keywords win over OTEL_TRAIN_* variables; everything not given here can still be set there.
        ot.init(save_path=args.save_path, enabled=True, log_bridge=True, log_level="INFO")
    use_cuda = torch.cuda.is_available()
    init_distributed("nccl" if use_cuda else "gloo", datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    faults = Faults(args, rank)
    features, classes = 64, 10

    with ot.log_trace_span("build.model"):
        net: nn.Module = Net(features, args.hidden, classes, faults).to(device)
        model = DistributedDataParallel(net, device_ids=[local_rank] if use_cuda else None)
        runnable: nn.Module = torch.compile(model) if args.compile else model
    with ot.log_trace_span("build.optimizer"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with ot.log_trace_span("build.data"):
        train = synthetic_data(args.steps * args.batch_size * world, features, classes, seed=1)
        held_out = synthetic_data(256, features, classes, seed=2)
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                            pin_memory=use_cuda, drop_last=True,
                            multiprocessing_context="fork" if args.num_workers else None)
        batches = iter(ott.traced(FaultyIterable(loader, faults)))

    metrics_group = None
    if args.fault or args.metrics:
        metrics_group = dist.new_group(timeout=datetime.timedelta(seconds=args.timeout_s), group_desc="metrics")
    handle = ott.instrument(runnable, optimizer)
    optimizer.register_step_pre_hook(lambda *_: faults.inject(phases.OPTIMIZER))  # after ours: inside the span
    checkpoint = Path(args.save_path) / "checkpoints" / "last.pt"
    start = 0
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
        log.info("resumed from %s after step %d", checkpoint, state["step"])
    waited = cpu_wait_ms()
    for step in range(start, args.steps):
        faults.step = step
        if args.fr_dump_after is not None and step == args.fault_step:
            fr_dump_later(args.fr_dump_after, Path(args.save_path) / "flight_recorder", rank)
        with ot.training_step(step, epoch=0):
            x, y = ott.batch_to_device(next(batches), device, non_blocking=use_cuda)
            loss = nn.functional.cross_entropy(runnable(x), y)
            ott.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if metrics_group is not None:
                all_reduce_metrics(loss, metrics_group, faults)
            if args.checkpoint_every and step and step % args.checkpoint_every == 0:
                save_checkpoint(model, optimizer, checkpoint, rank, faults, step)
            if args.eval_every and step and step % args.eval_every == 0:
                evaluate(runnable, held_out, device, faults)
            if args.cpu_wait:
                waited, before = cpu_wait_ms(), waited
                ot.log_trace_scalar({"cpu_wait_ms": waited - before})
        if step % 10 == 0:
            ot.log_trace_scalar({"loss": loss.item()})  # .item() syncs: only every 10 steps
    eval_loss = evaluate(runnable, held_out, device, faults)
    handle.remove()
    if rank == 0:
        log.info("done: %d steps, eval loss %.4f", args.steps, eval_loss)
    dist.destroy_process_group()
    ot.shutdown()
    if watcher is not None:
        try:
            watcher.wait(timeout=30)  # it ends once every rank has ended: let it print its last table
        except subprocess.TimeoutExpired:
            pass  # still following a rank that has not ended: it goes on in its own session


if __name__ == "__main__":
    main()
    # DDP keeps gloo's process group, with its worker threads, alive past destroy_process_group; a
    # worker still letting go of its last op's tensors while the interpreter finalizes aborts the
    # process (torch's, with or without otel-train: docs/comm.md, "Exit").
    # Everything is written by now: leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
