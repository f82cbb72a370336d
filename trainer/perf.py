"""GPU throughput settings that change no maths (docs/benchmarks.md, "End-to-end training").

Without apex or Transformer Engine megatron-core falls back to `torch.optim.AdamW` in its
default multi-tensor (foreach) form: several passes over every fp32 state tensor per step.
torch's fused AdamW does the whole update in one pass.
"""

from __future__ import annotations

import torch


def _torch_adams(optimizer: object) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW instances inside a megatron optimizer (chained or not)."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(inner)
    return found


def use_fused_adam(optimizer: object) -> int:
    """Switch megatron's torch (Adam)W fallback to torch's fused CUDA kernel; returns how many
    torch optimizers were switched (0 where a parameter is not a CUDA float tensor, e.g. CPU)."""
    switched = 0
    for adam in _torch_adams(optimizer):
        params = [p for group in adam.param_groups for p in group["params"]]
        if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
            continue
        for group in [adam.defaults, *adam.param_groups]:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched
