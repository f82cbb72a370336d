"""Let megatron-core run on a machine without CUDA (tests, laptops, CI).

megatron-core has no CPU path: it allocates on `torch.cuda.current_device()`, keeps its RNG
tracker in CUDA generator states, calls `torch.cuda.synchronize()` while checkpointing, creates a
few optimizer and pipeline-schedule scalars with `device="cuda"`, under context parallelism
moves pinned RoPE slice indices to CUDA, under pipeline parallelism moves the tied embedding to
CUDA and pairs pipeline messages in an order gloo does not keep, and its distributed optimizer
accepts only parameters whose `Tensor.type()` names a CUDA type and gathers its checkpoint state
through `.cuda()` unless told to use gloo.
`enable_cpu_mode()` redirects exactly those to the CPU, in a process that runs on the CPU (a
machine without CUDA, or `trainer.device=cpu` on a GPU host); `disable_cpu_mode()` undoes it, so a
process that goes on to use the GPU (a test session on a GPU host) runs megatron's own code.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")
_undo: list[tuple[object, str, object]] = []  # (owner, name, original) per patch


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


def _as_if_on_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` while CPU tensors pass megatron's CUDA checks and moves.

    megatron's `DistributedOptimizer.__init__` sorts parameters by `param.type()`
    ('torch.cuda.FloatTensor', ...) and rejects anything else, and the pipeline's tied embedding
    is moved with `.cuda()` before its first all-reduce; the maths is the same on the CPU. Only
    the argument-less `type()` (a query) is renamed and `cuda()` leaves a CPU tensor where it is,
    and only during the call.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        type_, cuda = torch.Tensor.type, torch.Tensor.cuda

        def type_name(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            result = type_(self, *a, **k)
            if a or k or self.device.type != "cpu":
                return result
            return result.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = type_name  # type: ignore[method-assign]
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type, torch.Tensor.cuda = type_, cuda  # type: ignore[method-assign]

    return wrapper


def _gather_over_gloo(method: Callable[..., Any]) -> Callable[..., Any]:
    """`DistributedOptimizer.get_parameter_state_dp_zero` always on its gloo group: the NCCL-side
    path moves each shard to CUDA, and on the CPU both groups are gloo ones anyway."""

    @functools.wraps(method)
    def wrapper(self: Any, use_gloo_comm: bool = True, **kwargs: Any) -> Any:
        return method(self, use_gloo_comm=True, **kwargs)

    return wrapper


# gloo matches a send to a receive from the same peer by tag and order; tag each message by its
# direction, activations forward (to the next stage) and gradients backward.
_FORWARD, _BACKWARD = 1, 2


def _tagged_p2p_ops(*, tensor_send_prev: torch.Tensor | None,
                    tensor_recv_prev: torch.Tensor | None,
                    tensor_send_next: torch.Tensor | None,
                    tensor_recv_next: torch.Tensor | None, group: Any,
                    prev_pipeline_rank: int, next_pipeline_rank: int) -> list:
    """megatron's `_batched_p2p_ops` with a tag per direction.

    With two stages and interleaving the previous and the next stage are the same process, and
    one batch both sends it an activation and a gradient of the same shape; untagged, gloo pairs
    them in posting order, which differs between the two sides, and swaps them silently.
    """
    dist = torch.distributed
    ops = [dist.P2POp(op, tensor, peer, group, tag)
           for op, tensor, peer, tag in (
               (dist.isend, tensor_send_prev, prev_pipeline_rank, _BACKWARD),
               (dist.irecv, tensor_recv_prev, prev_pipeline_rank, _FORWARD),
               (dist.isend, tensor_send_next, next_pipeline_rank, _FORWARD),
               (dist.irecv, tensor_recv_next, next_pipeline_rank, _BACKWARD))
           if tensor is not None]
    return dist.batch_isend_irecv(ops) if ops else []


_MISSING = object()


def _patch(owner: object, name: str, value: object) -> None:
    """owner.name = value, remembering the original (or its absence) for `disable_cpu_mode`."""
    _undo.append((owner, name, getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


def enable_cpu_mode() -> bool:
    """Patch megatron-core for a process that runs on the CPU (with or without a GPU present).
    Returns False if it already was."""
    if _undo:
        return False
    cpu = torch.device("cpu")
    # Allocation device, synchronisation and the default CUDA generator all map onto the CPU.
    _patch(torch.cuda, "current_device", lambda: cpu)
    _patch(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    _patch(torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    _patch(torch.cuda, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
    _patch(torch.cuda, "manual_seed", lambda seed: None)

    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.layers as tp_layers
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.utils as mcore_utils
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _patch(tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    _patch(tp_random, "_set_cuda_rng_state",
           lambda state, *args, **kwargs: torch.set_rng_state(state))
    for module in (mcore_utils, optimizer, clip_grads, grad_scaler, schedules):
        _patch(module, "torch", _CudaToCpuTorch("torch"))
    _patch(optimizer, "clip_grad_by_total_norm_fp32", _clip_grads_cpu)
    # Its advice to set CUDA_DEVICE_MAX_CONNECTIONS (TP > 1) concerns CUDA streams: none here.
    _patch(tp_layers.linear_with_grad_accumulation_and_async_allreduce, "warned", True)
    _patch(rotary, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank)
    _patch(yarn, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank)
    _patch(p2p, "_batched_p2p_ops", _tagged_p2p_ops)
    optimizer_class = distrib_optimizer.DistributedOptimizer
    _patch(optimizer_class, "__init__", _as_if_on_cuda(optimizer_class.__init__))
    _patch(LanguageModule, "setup_embeddings_and_output_layer",
           _as_if_on_cuda(LanguageModule.setup_embeddings_and_output_layer))
    _patch(optimizer_class, "get_parameter_state_dp_zero",
           _gather_over_gloo(optimizer_class.get_parameter_state_dp_zero))
    return True


def disable_cpu_mode() -> None:
    """Undo `enable_cpu_mode`: megatron-core as imported (for a process that uses a GPU next)."""
    while _undo:
        owner, name, original = _undo.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def end_cpu_work() -> None:
    """After a process's CPU work: on a GPU host undo the patches, since the process may use the
    GPU next; without CUDA keep them (nothing else can run there)."""
    if torch.cuda.is_available():
        disable_cpu_mode()
