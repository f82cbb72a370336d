"""Training checkpoints: megatron `dist_checkpointing` (torch_dist), crash-safe and checked.

Layout under the checkpoints root:
    iter_0000020/                     one complete checkpoint per save
    latest_checkpointed_iteration.txt the newest *complete* step, replaced atomically
A save goes to `iter_XXXXXXX.tmp/`, is fsynced and renamed when every rank has written, and only
then the tracker moves, so a crash (even SIGKILL) mid-save leaves the previous checkpoint as the
one that loads. If one of megatron's writer processes dies, the save fails instead of hanging.

A load first checks the checkpoint (`ckpt.reader`): every file present and long enough, every
item's CRC, every pickle parsed with an allowlist, and every tensor the model asks for present
with the model's global shape. Only then is anything copied into the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from ckpt.reader import Checkpoint, CheckpointError
from models.gpt import transformer_config
from trainer.distributed import unwrap_model

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
# Settings that decide the parameters; a mismatch may keep every shape (heads x head size).
ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "ffn_hidden_size", "gated_linear_unit", "normalization",
                "add_qkv_bias", "head_wise_attn_gate")


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tensors do not fit the model it is loaded into (nothing was loaded)."""


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoints root (its latest complete checkpoint) or one `iter_*` directory."""
    path = Path(path)
    if (path / TRACKER).is_file():
        step = int((path / TRACKER).read_text().strip())
        ckpt = path / checkpoint_name(step)
        if not (ckpt / "metadata.json").is_file():
            raise FileNotFoundError(f"{path / TRACKER} names step {step}, but {ckpt} is missing "
                                    "or incomplete")
        return ckpt
    if re.fullmatch(r"iter_\d+", path.name) and (path / "metadata.json").is_file():
        return path
    raise FileNotFoundError(
        f"{path} is neither a checkpoints root (no {TRACKER}) nor a complete iter_* checkpoint"
    )


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
        rng_key(tp), _rng_state(), (tp,),
        (parallel_state.get_tensor_model_parallel_rank(),),
        # Replicated over data- and context-parallel ranks (megatron's training loop does the same).
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
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
    state = _state_dict(model, optimizer, is_loading=False, with_rng=True)
    state["scheduler"] = scheduler.state_dict()
    state["extra"] = extra
    return write_checkpoint(root, step, state, thread_count)


def write_checkpoint(root: str | os.PathLike, step: int, state: dict[str, Any],
                     thread_count: int = 1) -> Path:
    """Save a sharded state dict as `root/iter_<step>` (collective): temporary directory, fsync,
    rename, then the tracker."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / (checkpoint_name(step) + ".tmp")
    if dist.get_rank() == 0:
        if tmp.exists():  # left by a crashed save: never part of a complete checkpoint
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)
    with _fail_if_a_child_dies(f"writing {tmp}"):
        dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy)
    dist.barrier()

    if dist.get_rank() == 0:
        _fsync_tree(tmp)
        old = root / (checkpoint_name(step) + ".old")
        if final.exists():  # re-saving a step: keep the old one until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _write_tracker(root, step)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


@contextlib.contextmanager
def _fail_if_a_child_dies(doing: str) -> Iterator[None]:
    """Raise if a child process is killed while `doing`.

    megatron's writer forks one process per file and waits on a queue for it; if that process
    is killed (OOM killer, a signal) the wait never ends. SIGCHLD interrupts the wait, and the
    handler raises. Only in the main thread (Python runs signal handlers there).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    dead_before = {pid for pid, _ in _killed_children()}

    def on_child(signum: int, frame: Any) -> None:
        for pid, sig in _killed_children():
            if pid not in dead_before:
                raise RuntimeError(f"a checkpoint writer process (pid {pid}) was killed by signal "
                                   f"{sig} while {doing}; the previous checkpoint is intact")

    previous = signal.signal(signal.SIGCHLD, on_child)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


def _killed_children() -> list[tuple[int, int]]:
    """(pid, signal) of this process's children killed by a signal and not yet reaped."""
    killed = []
    for child in psutil.Process().children():
        try:  # WNOWAIT: look, but leave the child for multiprocessing to reap
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            killed.append((child.pid, info.si_status))
    return killed


def _fsync_tree(directory: Path) -> None:
    """Flush a checkpoint's files and directory entries to disk before it is published."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(root: Path, step: int) -> None:
    tmp = root / (TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    _fsync_dir(root)


def saved_extra(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The plain-Python part of a checkpoint (step, config, data position, wandb id)."""
    return Checkpoint(ckpt_dir).extra


def open_checked(ckpt_dir: str | os.PathLike) -> Checkpoint:
    """The checkpoint, checked on every rank (collective): files present and long enough, CRCs
    (each rank checks a share of the items) and pickles. Raises `CheckpointError` listing every
    problem on every rank, so no rank goes on to wait for the others."""
    problems: list[str] = []
    ckpt = None
    try:
        ckpt = Checkpoint(ckpt_dir)
        problems = ckpt.check_files()
        if not problems:
            problems = ckpt.audit((dist.get_rank(), dist.get_world_size()))
    except CheckpointError as e:
        problems = [str(e)]
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank_problems in everyone for p in rank_problems})
    if found or ckpt is None:
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged or unsafe to load:\n  "
                              + "\n  ".join(found))
    return ckpt


def load_checkpoint(ckpt_dir: str | os.PathLike, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any) -> dict[str, Any]:
    """Load model, optimizer, scheduler and (when saved at this TP size) RNG state; returns
    `extra`.

    Model and optimizer state reshard to the current TP size; RNG states are per TP rank and are
    restored only when the checkpoint holds them for the current TP size.
    """
    ckpt = open_checked(ckpt_dir)
    extra = ckpt.extra
    if optimizer is not None and extra.get("model_only"):
        raise CheckpointError(f"{ckpt_dir} holds model weights only (written by `python -m ckpt "
                              "reshape --model-only`): there is no optimizer state to resume from")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    with_rng = any(key.startswith(rng_key(tp) + "/") for key in ckpt.objects)
    template = _state_dict(model, optimizer, is_loading=True, with_rng=with_rng)
    mismatches = architecture_mismatches(ckpt, unwrap_model(model).config)
    mismatches += template_mismatches(ckpt, template, with_optimizer=optimizer is not None)
    loaded = _load_if_fits(ckpt_dir, template, mismatches)
    unwrap_model(model).load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if "scheduler" in loaded:  # not in model-only checkpoints
        scheduler.load_state_dict(loaded["scheduler"])
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    else:
        log.info("the checkpoint holds no RNG states for TP=%d: they start fresh", tp)
    return extra


def load_model_weights(ckpt_dir: str | os.PathLike, model: torch.nn.Module) -> dict[str, Any]:
    """Model weights only (evaluation), with `load_checkpoint`'s file and shape checks; the
    model's attention variant may differ from the saved one as long as its tensors match.
    Returns `extra`."""
    ckpt = open_checked(ckpt_dir)
    template = _state_dict(model, None, is_loading=True, with_rng=False)
    mismatches = template_mismatches(ckpt, template, with_optimizer=False)
    unwrap_model(model).load_state_dict(_load_if_fits(ckpt_dir, template, mismatches)["model"])
    return ckpt.extra


def _load_if_fits(ckpt_dir: str | os.PathLike, template: dict[str, Any],
                  mismatches: list[str]) -> dict[str, Any]:
    """Refuse before touching any weight if the checkpoint does not fit, else load."""
    if mismatches:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} does not fit this model (nothing was loaded):\n  "
            + "\n  ".join(mismatches))
    try:
        return dist_checkpointing.load(template, str(ckpt_dir))
    except Exception as e:
        raise CheckpointError(f"loading {ckpt_dir} failed: {type(e).__name__}: {e}") from e


def architecture_mismatches(ckpt: Checkpoint, config: Any) -> list[str]:
    """Model settings that differ between the checkpoint's saved config and `config`."""
    if "config" not in ckpt.extra:
        return []
    saved = ckpt.config
    try:
        saved_config = transformer_config(saved.model, saved.attention)
    except (AttributeError, KeyError, ValueError) as e:  # a config from another schema version
        log.warning("cannot rebuild the checkpoint's model config (%s): checking tensors only", e)
        return []
    return [f"model setting {name}: checkpoint {getattr(saved_config, name)}, this model "
            f"{getattr(config, name)}"
            for name in ARCHITECTURE if getattr(saved_config, name) != getattr(config, name)]


def template_mismatches(ckpt: Checkpoint, template: dict[str, Any], *,
                        with_optimizer: bool) -> list[str]:
    """Tensors and objects a load of `template` would ask for that the checkpoint lacks or holds
    at another global shape, and model (and optimizer) tensors the template would leave behind."""
    tensors, objects = expected_entries(template)
    problems = []
    for key, shape in sorted(tensors.items()):
        info = ckpt.tensors.get(key)
        if info is None:
            problems.append(f"{key}: not in the checkpoint (the model has {list(shape)})")
        elif info.shape != shape:
            problems.append(f"{key}: checkpoint {list(info.shape)}, model {list(shape)}")
    for key in sorted(set(ckpt.tensors) - set(tensors)):
        if with_optimizer or not key.startswith("optimizer."):
            problems.append(f"{key}: in the checkpoint {list(ckpt.tensors[key].shape)}, not in "
                            "the model")
    problems += [f"{key}: object not in the checkpoint"
                 for key in sorted(objects - set(ckpt.objects))]
    return problems


def expected_entries(template: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Global shapes of the tensors and keys of the objects a sharded state dict stores (its
    factories built, as megatron does when loading; the template is left as it is)."""
    tensors: dict[str, tuple[int, ...]] = {}
    objects: set[str] = set()
    pending = list(nested_values(template))
    while pending:
        value = pending.pop()
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            pending.extend(nested_values(built) if isinstance(built, (dict, list)) else [built])
        elif isinstance(value, ShardedTensor):
            tensors[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedObject):
            objects.add(value.unique_key)
    return tensors, objects

