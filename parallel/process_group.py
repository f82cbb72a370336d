"""The device and the process group, with torch alone (no megatron-core).

`python -m trainer` under torchrun joins the group first, to give every rank rank 0's run
directory, and reports a mistyped override or a refused directory before megatron-core and the
model code are imported (about 4 of the 7 seconds a short run spends importing on 2 cores).
`parallel.distributed.init_process_group` adds megatron's patches for the machine; the device
itself is chosen by `parallel.placement.resolve_device`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def join_process_group(device: torch.device) -> None:
    """Join torchrun's group, or form a group of one; nothing if this process is in a group."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)  # torchrun's env:// rendezvous
    else:
        # A group of one needs no rendezvous: an in-memory store, no port to race for.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
