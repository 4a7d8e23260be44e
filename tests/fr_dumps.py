"""Make the real Flight Recorder dumps under ``tests/data/fr/`` (torch 2.13, gloo, 2 ranks on CPU).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 tests/fr_dumps.py tests/data/fr

Both ranks issue the same collectives on the default group and on a second group (and send/recv,
which gloo's Flight Recorder does not record), then dump in process, as torch's own dump names it
(``fr_trace_<rank>``: pickle, ``_dump_fr_trace``) and as JSON (``rank_<rank>.json``,
``_dump_fr_trace_json``). Then rank 0 issues one more all_reduce that rank 1 never joins, and both dump
again under ``later/`` (``host-a.rank0.pkl``, ``host-b.rank1.pkl``): a second incident in which rank 0
waits in all_reduce #8 of group ``0``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # read when a process group is created

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_c10d = torch._C._distributed_c10d


def _dump(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.all_gather([torch.zeros(4) for _ in range(2)], t)
    dist.all_gather_into_tensor(torch.zeros(8), t)
    dist.barrier()
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(3, dtype=torch.int64), group=sub)
    if rank == 0:
        dist.send(torch.ones(5), 1)
    else:
        dist.recv(torch.zeros(5), 0)
    dist.all_to_all_single(torch.zeros(4), torch.ones(4))
    dist.all_reduce(torch.ones(2, dtype=torch.float16))
    _dump(out / f"fr_trace_{rank}", _c10d._dump_fr_trace())
    _dump(out / f"rank_{rank}.json", _c10d._dump_fr_trace_json())
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        dist.all_reduce(torch.ones(6), async_op=True)  # rank 1 never joins it
        _dump(out / "later" / "host-a.rank0.pkl", _c10d._dump_fr_trace())
        store.set("rank0_dumped", "1")
    else:
        store.wait(["rank0_dumped"])
        _dump(out / "later" / "host-b.rank1.pkl", _c10d._dump_fr_trace())
    sys.stdout.flush()
    os._exit(0)  # rank 0's all_reduce never completes: no orderly teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]))
