"""A DDP comm hook that issues the reducer's bucket all-reduces through ``torch.distributed.all_reduce``,
so the recorder sees each one with host timing (Python wrappers never see what the reducer issues
from C++; Flight Recorder does, when its buffer existed before the group: docs/comm.md).

The hook is PyTorch's own default (``allreduce_hook``: divide by the group size, all-reduce, the same
arithmetic as DDP without a hook). It is installed only on a DDP model without a hook of its own; a
hook the script registers later replaces ours inside it (DDP takes only one), so that call still works.
"""

from __future__ import annotations

from typing import Any

HOOK_NAME = "otel_train_allreduce_hook"


def install(model: Any) -> bool:
    """Install the hook on ``model`` (a DistributedDataParallel); whether it was installed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or getattr(model, "_comm_hooks", None):
        return False
    if getattr(model, "logger", None) is None or getattr(model, "_use_python_reducer", False):
        return False
    slot: dict[str, Any] = {"hook": None, "state": None}

    def otel_train_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        hook = slot["hook"]
        if hook is not None:
            return hook(slot["state"], bucket)
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(model.process_group, otel_train_allreduce_hook)

    def register_comm_hook(state: object, hook: Any) -> None:
        if slot["hook"] is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        model._check_comm_hook(hook)
        slot.update(hook=hook, state=state)
        model._comm_hooks.append((hook, state))

    def _register_builtin_comm_hook(comm_hook_type: Any) -> None:
        import torch.distributed as dist

        builtin = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        register_comm_hook(model.process_group, builtin[comm_hook_type])

    model.register_comm_hook = register_comm_hook
    model._register_builtin_comm_hook = _register_builtin_comm_hook
    return True
