"""torchtitan's real trainer on CPU, for the tests (issue 44, item 3): the wrapper torchrun runs.

    torchrun --nproc_per_node=2 tests/titan_trainer.py --module llama3 --config llama3_debugmodel ...

What CPU and torch 2.13.0 need, each done here and nowhere in the package: the device type set to
``cpu`` before torchtitan is imported (several modules copy it at import); a stub for the hard
``import triton`` on a MoE path llama3 never uses; ``TORCHDYNAMO_DISABLE=1`` with flex attention's
device check relaxed for CPU tensors; the device memory monitor stubbed; a plain ``barrier()`` in
``set_pg_timeouts`` and ``distributed_c10d._set_pg_timeout`` for gloo's missing ``set_timeout``;
FSDP2's ``set_force_sum_reduction_for_comms(True)`` (gloo refuses ``PREMUL_SUM``).

Faults (``TITAN_FAULT``): ``slow_data:<rank>:<step>:<seconds>``, ``hang_data:<rank>:<step>``,
``kill_forward:<rank>:<step>``, ``hang_forward:<rank>:<step>``, ``slow_forward:<rank>:<step>:<seconds>``;
``<step>+`` is that step and every later one.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


class _Anything(types.ModuleType):
    """A stand-in module: any attribute is a placeholder that can be called, indexed or decorated with."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder


def _placeholder(*args: object, **_: object) -> object:
    if len(args) == 1 and callable(args[0]):
        return args[0]  # @triton.jit
    return _placeholder


def _stub_triton() -> None:
    """llama3 never runs the MoE kernels whose module imports triton at import time: that module alone
    is imported with a stand-in, which is then removed so torch still finds no triton."""
    triton, lang = _Anything("triton"), _Anything("triton.language")
    triton.language = lang
    sys.modules["triton"], sys.modules["triton.language"] = triton, lang
    try:
        import torchtitan.distributed.minimal_async_ep.kernels  # noqa: F401
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


def _cpu() -> None:
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"


def _cpu_patches() -> None:
    """After torchtitan is imported: what its trainer needs to run on CPU with gloo."""
    from datetime import timedelta  # noqa: F401

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils

    class _NoDeviceMemory:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self) -> object:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            return None

    metrics.build_device_memory_monitor = _NoDeviceMemory
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: dist.barrier()
    if not hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.distributed_c10d._set_pg_timeout = lambda timeout, group=None: None
    init = _fsdp_param_group.FSDPParamGroup.__init__

    def force_sum(self: object, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self.force_sum_reduction_for_comms = True  # gloo refuses PREMUL_SUM

    _fsdp_param_group.FSDPParamGroup.__init__ = force_sum
    # Flex attention refuses backward on CPU tensors; with dynamo off its eager path trains correctly.
    import torch.nn.attention.flex_attention as flex

    flex._validate_device = lambda *args, **kwargs: None
    del torch


def _faults() -> None:
    """``TITAN_FAULT=<kind>:<rank>:<step>[:<seconds>]``: in the data load (inside their
    ``fetching_batch`` span) or in the model's forward (inside ``fwd_bwd``) of that rank at that step.
    A fault that fires writes ``<dump>/fault.<rank>`` first (``TITAN_FAULT_MARK``: the folder)."""
    spec = os.environ.get("TITAN_FAULT")
    if not spec:
        return
    import signal
    import time

    from torchtitan import trainer
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.observability.structured_logger.step_state import get_step

    kind, rank, step, *rest = spec.split(":")
    seconds = float(rest[0]) if rest else 0.0
    me = int(os.environ.get("RANK", "0"))

    first, every = int(step.rstrip("+")), step.endswith("+")  # "<step>+": that step and every later one

    def fire() -> None:
        now = get_step()
        if me != int(rank) or now is None or not (now == first or (every and now > first)):
            return
        mark = os.environ.get("TITAN_FAULT_MARK")
        if mark:
            with open(os.path.join(mark, f"fault.{me}"), "w") as f:
                f.write(kind)
        if kind.startswith("slow"):
            time.sleep(seconds)
        elif kind.startswith("hang"):
            while True:
                time.sleep(60)
        elif kind == "kill_forward":
            os.kill(os.getpid(), signal.SIGKILL)

    if kind.endswith("_data"):
        generator = trainer.Trainer.batch_generator

        def batches(self: object, data: object) -> object:
            for batch in generator(self, data):
                yield batch
                fire()  # runs inside the next fetching_batch span: the next step's data load

        trainer.Trainer.batch_generator = batches
    else:
        forward = Llama3Model.forward

        def faulty(self: object, *args: object, **kwargs: object) -> object:
            fire()
            return forward(self, *args, **kwargs)

        Llama3Model.forward = faulty


def make_assets(root: str) -> None:
    """``<root>/tests/assets/tokenizer`` (a byte-level BPE of 2,048 tokens trained here with the
    ``tokenizers`` library) and ``<root>/tests/assets/c4_test`` (generated text): what the llama3
    debugmodel config reads, relative to the working directory, with no hub."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(400)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 400))) + "." for _ in range(200)]
    data = os.path.join(root, "tests", "assets", "c4_test")
    tok_dir = os.path.join(root, "tests", "assets", "tokenizer")
    os.makedirs(data, exist_ok=True)
    os.makedirs(tok_dir, exist_ok=True)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}, f)


def main() -> None:
    _cpu()
    _stub_triton()
    from torchtitan import train

    if sys.argv[1:2] == ["--make-assets"]:
        make_assets(sys.argv[2])
        return
    _cpu_patches()
    _faults()
    train.main()


if __name__ == "__main__":
    main()
