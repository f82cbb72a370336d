"""What a training checkpoint holds: the sharded state dict of model, optimizer and RNG states.

The same function builds the dict for saving and the template for loading, so the two agree on
every key; the optimizer state uses megatron's fully reshardable sharding (any TP size loads it).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from parallel.distributed import unwrap_model

OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def rng_key(tp: int, pp: int = 1) -> str:
    """RNG states are saved per TP (and PP) size: they only make sense at the layout they were
    taken at."""
    return f"rng_state/tp{tp}" if pp == 1 else f"rng_state/tp{tp}_pp{pp}"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object() -> ShardedObject:
    """RNG states differ per TP rank and pipeline stage and repeat across DP replicas."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    shape, offset = ((tp,), (tp_rank,)) if pp == 1 else \
        ((pp, tp), (parallel_state.get_pipeline_model_parallel_rank(), tp_rank))
    return ShardedObject(
        rng_key(tp, pp), _rng_state(), shape, offset,
        # Replicated over data- and context-parallel ranks (megatron's training loop does the same).
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def chunk_list(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """This rank's model chunks (one without interleaved pipelining), unwrapped."""
    return [unwrap_model(m) for m in (model if isinstance(model, list) else [model])]


def model_state(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, Any]:
    """The model's sharded state dict; with several pipeline chunks one per chunk (`model0`,
    ... as megatron names them). Tensor keys are global (layer numbers offset by the stage), so
    any layout loads them."""
    chunks = chunk_list(model)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def load_model_state(model: torch.nn.Module | list[torch.nn.Module],
                     loaded: dict[str, Any]) -> None:
    """`model_state`'s counterpart: loaded tensors into each chunk."""
    chunks = chunk_list(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded)
        return
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])


def allocate_optimizer_state(optimizer: Any) -> None:
    """Give torch Adam's empty state its tensors and step before a load builds its template.

    megatron's distributed optimizer asks the inner optimizer for its step while building the
    template, which torch's Adam (without Apex or Transformer Engine) has only after a first
    step. megatron's own `init_state_fn` allocates the moments; the step starts at 0.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        init = getattr(opt, "init_state_fn", None)
        if inner is None or init is None or len(inner.state) or not hasattr(opt, "gbuf_ranges"):
            continue
        init(inner, opt.config)
        for state in inner.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))


def training_state(model: torch.nn.Module | list[torch.nn.Module], optimizer: Any, *,
                   is_loading: bool, with_rng: bool) -> dict[str, Any]:
    """Model (every chunk of this rank), optimizer and RNG state as megatron shards them."""
    model_sd = model_state(model)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        if is_loading:
            allocate_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=OPTIMIZER_SHARDING
        )
    if with_rng:
        state["rng_state"] = _rng_sharded_object()
    return state
