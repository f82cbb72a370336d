"""Training checkpoints: megatron `dist_checkpointing` (torch_dist), crash-safe.

Layout under the checkpoints root:
    iter_0000020/                     one complete checkpoint per save
    latest_checkpointed_iteration.txt the newest *complete* step, replaced atomically
A save goes to `iter_XXXXXXX.tmp/`, is renamed when every rank has written, and only then the
tracker moves, so a crash mid-save leaves the previous checkpoint as the one that loads.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from trainer.distributed import unwrap_model

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoints root (its latest complete checkpoint) or one `iter_*` directory."""
    path = Path(path)
    if (path / TRACKER).is_file():
        step = int((path / TRACKER).read_text().strip())
        return path / checkpoint_name(step)
    if path.name.startswith("iter_") and (path / "metadata.json").is_file():
        return path
    raise FileNotFoundError(
        f"{path} is neither a checkpoints root (no {TRACKER}) nor a complete iter_* checkpoint"
    )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object() -> ShardedObject:
    """RNG states differ per TP rank and repeat across DP replicas."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject(
        f"rng_state/tp{tp}", _rng_state(), (tp,),
        (parallel_state.get_tensor_model_parallel_rank(),),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _state_dict(model: torch.nn.Module, optimizer: Any, *, is_loading: bool,
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


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any, extra: dict[str, Any], thread_count: int = 1) -> Path:
    """Write `root/iter_<step>` atomically; `extra` (step, data position, config, wandb id...)
    holds only plain Python values and tensors so it loads with `weights_only=True`."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / (checkpoint_name(step) + ".tmp")
    if dist.get_rank() == 0:
        if tmp.exists():  # left by a crashed save: never part of a complete checkpoint
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()

    state = _state_dict(model, optimizer, is_loading=False, with_rng=True)
    state["scheduler"] = scheduler.state_dict()
    state["extra"] = extra
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)
    dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy)
    dist.barrier()

    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_tracker(root, step)
    dist.barrier()
    return final


def _write_tracker(root: Path, step: int) -> None:
    tmp = root / (TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)


def saved_extra(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The plain-Python part of a checkpoint (step, config, data position, wandb id)."""
    return dist_checkpointing.load_common_state_dict(str(ckpt_dir))["extra"]


def load_checkpoint(ckpt_dir: str | os.PathLike, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any) -> dict[str, Any]:
    """Load model, optimizer, scheduler and (at the same TP size) RNG state; returns `extra`.

    Model and optimizer state reshard to the current TP size; RNG states are per TP rank and are
    restored only when the TP size is unchanged.
    """
    extra = saved_extra(ckpt_dir)
    same_tp = extra.get("tp") == parallel_state.get_tensor_model_parallel_world_size()
    template = _state_dict(model, optimizer, is_loading=True, with_rng=same_tp)
    loaded = dist_checkpointing.load(template, str(ckpt_dir))
    unwrap_model(model).load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_tp:
        _set_rng_state(loaded["rng_state"])
    else:
        log.info("TP size changed (%s -> %s): RNG states start fresh", extra.get("tp"),
                 parallel_state.get_tensor_model_parallel_world_size())
    return extra
