"""Let megatron-core run on a machine without CUDA (tests, laptops, CI).

megatron-core has no CPU path: it allocates on `torch.cuda.current_device()`, keeps its RNG
tracker in CUDA generator states, calls `torch.cuda.synchronize()` while checkpointing, creates a
few optimizer scalars with `device="cuda"` and, under context parallelism, moves pinned RoPE slice
indices to CUDA. `enable_cpu_mode()` redirects exactly those to the CPU.
It does nothing when CUDA is present, so the GPU path is megatron's own, untouched.
"""

from __future__ import annotations

import types
from typing import Any

import torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")
_enabled = False


class _CudaToCpuTorch(types.ModuleType):
    """Stands in for `torch` inside a few megatron modules: tensor factories asked for a CUDA
    device get the CPU instead; everything else is torch itself."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return attr(*args, device=device, **kwargs)

        return factory


def _clip_grads_cpu(parameters: list, max_norm: float, total_norm: float,
                    use_decoupled_grad: bool = False) -> None:
    """megatron's `clip_grad_by_total_norm_fp32` asserts CUDA tensors; same maths on CPU."""
    grads = [p.decoupled_grad if use_decoupled_grad else p.grad for p in parameters]
    grads = [g for g in grads if g is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int,
                             cp_group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """megatron's `get_pos_emb_on_this_cp_rank` (pieces r and 2N-1-r of the rotary table) without
    its pinned memory and `.cuda()`."""
    size, rank = cp_group.size(), cp_group.rank()
    pieces = pos_emb.unflatten(seq_dim, (2 * size, -1))
    index = torch.tensor([rank, 2 * size - 1 - rank], device=pos_emb.device)
    return pieces.index_select(seq_dim, index).flatten(seq_dim, seq_dim + 1)


def enable_cpu_mode() -> bool:
    """Patch megatron-core for CPU execution when CUDA is absent. Returns True if patched."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True

    cpu = torch.device("cpu")
    # Allocation device, synchronisation and the default CUDA generator all map onto the CPU.
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()  # type: ignore
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)  # type: ignore
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]

    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.utils as mcore_utils

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    for module in (mcore_utils, optimizer, clip_grads, grad_scaler):
        module.torch = _CudaToCpuTorch("torch")  # type: ignore[attr-defined]
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grads_cpu
    rotary.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    yarn.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    _enabled = True
    return True
