"""parallel.cpu_mode: its patches apply in a process that runs on the CPU and are undone exactly,
so a process on a GPU host can run CPU work (`trainer.device=cpu`, a CPU test) and then use the
GPU with megatron's own code."""

from __future__ import annotations

import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
import megatron.core.tensor_parallel.layers as tp_layers
import megatron.core.utils as mcore_utils
import torch

from parallel import cpu_mode

WATCHED = [(torch.cuda, "current_device"), (torch.cuda, "synchronize"), (mcore_utils, "torch"),
           (distrib_optimizer.DistributedOptimizer, "__init__")]


def _snapshot() -> list[object]:
    return [getattr(owner, name) for owner, name in WATCHED]


def test_enable_patches_and_disable_restores_exactly() -> None:
    was_enabled = bool(cpu_mode._undo)
    cpu_mode.disable_cpu_mode()
    try:
        pristine = _snapshot()
        warned = hasattr(tp_layers.linear_with_grad_accumulation_and_async_allreduce, "warned")
        assert cpu_mode.enable_cpu_mode() is True
        assert cpu_mode.enable_cpu_mode() is False  # once
        assert torch.cuda.current_device() == torch.device("cpu")
        assert mcore_utils.torch.zeros(2, device="cuda").device.type == "cpu"
        assert all(a is not b for a, b in zip(_snapshot(), pristine, strict=True))
        cpu_mode.disable_cpu_mode()
        assert all(a is b for a, b in zip(_snapshot(), pristine, strict=True))
        assert hasattr(tp_layers.linear_with_grad_accumulation_and_async_allreduce,
                       "warned") == warned
    finally:
        if was_enabled:  # as this process had it
            cpu_mode.enable_cpu_mode()
