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


def rng_key(tp: int) -> str:
    """RNG states are saved per TP size: they only make sense at the size they were taken at."""
    return f"rng_state/tp{tp}"


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
    """RNG states differ per TP rank and repeat across DP replicas."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject(
        rng_key(tp), _rng_state(), (tp,),
        (parallel_state.get_tensor_model_parallel_rank(),),
        # Replicated over data- and context-parallel ranks (megatron's training loop does the same).
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def training_state(model: torch.nn.Module, optimizer: Any, *, is_loading: bool,
                with_rng: bool) -> dict[str, Any]:
    model_sd = unwrap_model(model).sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=OPTIMIZER_SHARDING
        )
    if with_rng:
        state["rng_state"] = _rng_sharded_object()
    return state
