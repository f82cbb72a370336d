"""Fused RoPE for megatron's own `apply_rope_fusion` path, without Transformer Engine.

megatron applies RoPE to q and k of every standard layer. Its unfused path (rope_utils'
`_apply_rotary_pos_emb_bshd`) takes cos and sin of the frequency table, casts them to bf16 and
runs five elementwise kernels per tensor (its share of a step: docs/benchmarks.md). With
`config.apply_rope_fusion` it calls `rope_utils.fused_apply_rotary_pos_emb` instead, which is
Transformer Engine's kernel when TE is installed and None otherwise. `install()` puts ours there
when the slot is empty: one Triton pass each way (`rotate`, on the kernels DCA rotates with),
arithmetic in float32 from float32 tables and one rounding to the output dtype. Selected by
`trainer.fused_rope` (models/gpt.py `transformer_config`).

megatron hands the table for this rank's tokens (context parallelism included), so each row of
`freqs` is the angle set of one token: positions are simply the rows, and packed (THD) sequences
restart at 0 per sequence, as megatron's unfused THD path does.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from models.attention.rope import rotate


def _half_tables(freqs: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [rows, d/2] of megatron's [rows, 1, 1, d] angle table, whose two
    halves repeat the same angles (rotate-half layout)."""
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[-1] != head_dim:
        raise ValueError(f"fused RoPE needs a [s, 1, 1, {head_dim}] frequency table (whole head "
                         f"rotated, no mRoPE), got {tuple(freqs.shape)}; use "
                         "trainer.fused_rope=false")
    angles = freqs[:, 0, 0, :head_dim // 2].float()
    return angles.cos().contiguous(), angles.sin().contiguous()


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                               transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """t [s, b, h, d] rotated by freqs [s, 1, 1, d] (Transformer Engine's signature)."""
    if interleaved:
        raise ValueError("fused RoPE supports the rotate-half layout only "
                         "(model.rotary_interleaved=false)")
    s = t.shape[0]
    cos_half, sin_half = _half_tables(freqs[:s], t.shape[-1])
    positions = torch.arange(s, dtype=torch.int32, device=t.device)
    out = rotate(t.transpose(0, 1), positions, cos_half, sin_half)  # [b, s, h, d]
    return out.transpose(0, 1)  # [s, b, h, d]


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor,
                                   freqs: torch.Tensor, cp_size: int = 1,
                                   cp_rank: int = 0) -> torch.Tensor:
    """Packed sequences t [tokens, h, d]: each sequence of cu_seqlens from position 0."""
    if cp_size != 1:
        raise NotImplementedError("packed sequences are not supported with context parallelism")
    cos_half, sin_half = _half_tables(freqs, t.shape[-1])
    index = torch.arange(t.shape[0], device=t.device)
    cu = cu_seqlens.to(device=t.device, dtype=torch.int64)
    sequence = torch.searchsorted(cu[1:], index, right=True)
    positions = (index - cu[sequence]).to(torch.int32)
    return rotate(t.unsqueeze(0), positions, cos_half, sin_half)[0]


def install() -> None:
    """Fill megatron's fused-RoPE slots with ours where Transformer Engine left them empty
    (megatron's config validation refuses `apply_rope_fusion` while they are None)."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
