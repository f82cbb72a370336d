"""What the project uses of FlashAttention-4 (flash-attn-4) and of quack (its CuTe DSL helpers)
beyond FA4's public `flash_attn_func`: the names DCA's kernels and kernels.py import, the FA4
kernel methods they call or override, and the versions these were checked against.

FA4 is a beta whose internals move between releases; an upgrade that renames or moves one of
these breaks DCA's kernels. tests/models/test_fa4_api.py resolves every name below in the
pinned releases' sources (CI fetches them), and `check_version` says once at run time when the
installed FA4 is another release. The pins here and pyproject's `fa4` extra name the same
versions (a test holds them together).
"""

from __future__ import annotations

import logging
from importlib import metadata

FA4_DISTRIBUTION, FA4_VERSION = "flash-attn-4", "4.0.0b36"
QUACK_DISTRIBUTION, QUACK_VERSION = "quack-kernels", "0.6.5"

# module -> the names imported from it (functions, classes, constants)
NAMES: dict[str, tuple[str, ...]] = {
    "flash_attn.cute.interface": (
        "flash_attn_func", "flash_attn_varlen_func",  # kernels.py: causal attention
        "_flash_attn_fwd", "_flash_attn_bwd",  # kernels.py: with the LSE, merged backward
        "_bwd_preprocess", "_bwd_postprocess_convert",  # DCA backward: dPsum, dK/dV sums
        "_tile_size_fwd_sm90", "_tile_size_bwd_sm90",  # DCA kernels: FA4's tile choice
        "maybe_contiguous", "to_cute_tensor", "torch2cute_dtype_map", "AuxData"),
    "flash_attn.cute.flash_fwd_sm90": ("FlashAttentionForwardSm90",),
    "flash_attn.cute.flash_bwd_sm90": ("FlashAttentionBackwardSm90", "cpasync"),
    "flash_attn.cute.softmax": ("Softmax",),
    "flash_attn.cute.tile_scheduler": ("SingleTileLPTScheduler", "TileSchedulerArguments"),
    "flash_attn.cute.named_barrier": ("NamedBarrierBwd",),
    "flash_attn.cute.cute_dsl_utils": ("assume_tensor_aligned",),
    "flash_attn.cute.utils": ("compute_softmax_scale_log2", "get_smem_store_atom", "AuxData"),
    "flash_attn.cute.cache_utils": ("get_jit_cache",),
    "quack.copy_utils": ("tma_get_copy_fn", "tma_producer_copy_fn", "cpasync_bulk_get_copy_fn",
                         "cpasync_reduce_bulk_add_f32"),
    "quack.layout_utils": ("select",),
    "quack.sm90_utils": ("make_smem_layout", "partition_fragment_ABC", "gemm_zero_init",
                         "gemm_w_idx"),
}

# (module, kernel class) -> the methods DCA's subclasses override or call; the backward's
# `__call__` is FA4's, compiled as a copy (fa4_backward._reduce_add_call)
METHODS: dict[tuple[str, str], tuple[str, ...]] = {
    ("flash_attn.cute.flash_fwd_sm90", "FlashAttentionForwardSm90"): (
        "__call__", "load", "mma",  # overridden
        "_check_type", "_get_tiled_mma", "_setup_attributes", "_get_shared_storage_cls",
        "kernel", "mma_init", "first_half_block_overlap", "mma_one_n_block_intrawg_overlap",
        "last_half_block_overlap", "epilogue"),
    ("flash_attn.cute.flash_bwd_sm90", "FlashAttentionBackwardSm90"): (
        "load", "dQaccum_store",  # overridden
        "__call__"),
}

_log = logging.getLogger(__name__)
_checked: list[str] = []


def check_version() -> str | None:
    """The installed FA4 release when it is not FA4_VERSION (logged once), else None."""
    try:
        installed = metadata.version(FA4_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    if installed == FA4_VERSION:
        return None
    if installed not in _checked:
        _checked.append(installed)
        _log.warning("%s %s is installed; DCA's kernels were checked against %s (their FA4 "
                     "internals: models/attention/fa4_api.py)", FA4_DISTRIBUTION, installed,
                     FA4_VERSION)
    return installed
