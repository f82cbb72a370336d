"""Whether a KV cache fits: checked from the model's shape before any model is loaded, so a
batch or a prompt too large for the machine is one `error:` line, not an allocator traceback.
The cache's sizes live here, apart from the engine (which imports megatron), so a command
checks them before those imports."""

from __future__ import annotations

import math

import torch

from models.schema import ModelConfig, head_dim_of
from trainer.errors import UserError

GB = 1 << 30
LENGTH_MULTIPLE = 1024  # cache lengths are rounded up to this: one graph serves many lengths


def bucket(n: int, multiple: int) -> int:
    return multiple * math.ceil(n / multiple)


def kv_bytes(num_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
             itemsize: int) -> int:
    """Bytes of a cache of this shape (keys and values of every layer)."""
    return 2 * num_layers * batch * kv_heads * length * head_dim * itemsize


def cache_shape(batch: int, length: int, max_batch: int) -> tuple[int, int]:
    """The (rows, positions) the engine allocates for `batch` prompts of up to `length` tokens
    (prompt and new tokens) decoded `max_batch` at a time."""
    rows = min(max_batch, 1 << (max(1, min(batch, max_batch)) - 1).bit_length())
    return rows, bucket(length, LENGTH_MULTIPLE)


def cache_bytes(model: ModelConfig, rows: int, positions: int, itemsize: int) -> int:
    kv_heads = model.num_query_groups or model.num_attention_heads
    return kv_bytes(model.num_layers, rows, kv_heads, positions, head_dim_of(model), itemsize)


def cache_limit(max_cache_gb: float | None, device: torch.device) -> int:
    """The bound in bytes: `max_cache_gb`, or half the device's memory."""
    if max_cache_gb is not None:
        if not max_cache_gb > 0:
            raise UserError(f"decode.max_cache_gb={max_cache_gb}: give a positive size in GB, or "
                            "leave it unset (half the device's memory)")
        return int(max_cache_gb * GB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 2
    import psutil

    return psutil.virtual_memory().available // 2


def check_cache(model: ModelConfig, batch: int, length: int, max_batch: int, bf16: bool,
                max_cache_gb: float | None, device: torch.device, fix: str) -> None:
    """UserError when `batch` prompts of up to `length` tokens need a cache over the bound;
    `fix` names the settings that lower it."""
    rows, positions = cache_shape(batch, length, max_batch)
    need = cache_bytes(model, rows, positions, 2 if bf16 else 4)
    limit = cache_limit(max_cache_gb, device)
    if need > limit:
        bound = "as set" if max_cache_gb else "half the device's memory"
        raise UserError(f"the KV cache for {rows} prompt(s) of up to {length} tokens needs "
                        f"{need / GB:.1f} GB, over the {limit / GB:.1f} GB decode.max_cache_gb "
                        f"allows ({bound}): {fix}, or raise decode.max_cache_gb")
