"""Fused RoPE for megatron's own `apply_rope_fusion` path, without Transformer Engine.

megatron applies RoPE to q and k of every standard layer. Its unfused path (rope_utils'
`_apply_rotary_pos_emb_bshd`) takes cos and sin of the frequency table, casts them to bf16 and
runs five elementwise kernels per tensor (docs/benchmarks.md, "Fused RoPE"). With
`config.apply_rope_fusion` it calls `rope_utils.fused_apply_rotary_pos_emb` instead, which is
Transformer Engine's kernel when TE is installed and None otherwise. `install()` puts ours there
when the slot is empty: one Triton pass each way (`rotate`, on the kernels DCA rotates with),
arithmetic in float32 from float32 tables and one rounding to the output dtype. Selected by
`trainer.fused_rope` (models/gpt.py `transformer_config`).

With `config.fused_single_qkv_rope` megatron does not split the fused QKV projection itself but
hands it whole to `attention.apply_fused_qkv_rotary_pos_emb` (Transformer Engine's, when
installed). `install()` puts `fused_apply_qkv_rotary_pos_emb` there: the split and RoPE in one
pass each way. megatron's own split reshapes the query heads out of their groups
([s, b, groups, (q_per_group + 2) * d], the layout of the fused weight) with a copy, and its
backward concatenates the three gradients into the fused one: at 32K tokens of gpt_1p3b that
copy and that concatenation cost more than the rotations themselves. Here
the forward reads the query and key heads where they lie and writes them rotated, and the
backward writes the rotated-back gradients straight into the fused gradient's slots. megatron
takes this path only where every layer rotates (`models/gpt.py` turns it on so).

megatron hands the table for this rank's tokens (context parallelism included), so each row of
`freqs` is the angle set of one token: positions are simply the rows, and packed (THD) sequences
restart at 0 per sequence, as megatron's unfused THD path does.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention as megatron_attention

from models.attention.rope import rotate, rotate_multi, rotate_transpose_sum
from models.fused_qkv import qkv_slots


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


class _QKVRotate(torch.autograd.Function):
    """megatron's fused QKV output [s, b, groups, (q_per_group + 2) * d] -> (R q [s, b, heads,
    d], R k [s, b, groups, d], v [s, b, groups, d], a view of it), one read of q and k each way;
    the backward writes the fused gradient whole (no concatenation)."""

    @staticmethod
    def forward(ctx: Any, mixed: torch.Tensor, q_tables: tuple[torch.Tensor, torch.Tensor],
                k_tables: tuple[torch.Tensor, torch.Tensor],
                q_per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = torch.arange(mixed.shape[0], dtype=torch.int32,
                                 device=mixed.device)[None]  # [1, s]
        q, k, v = qkv_slots(mixed, q_per_group)
        q_rot = rotate_multi(q.transpose(0, 1), positions, *q_tables)[0]  # [b, s, heads, d]
        k_rot = rotate_multi(k.transpose(0, 1), positions, *k_tables)[0]  # [b, s, groups, d]
        ctx.save_for_backward(positions, *q_tables, *k_tables)
        ctx.layout = mixed.shape, mixed.dtype, q_per_group
        return q_rot.transpose(0, 1), k_rot.transpose(0, 1), v

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        positions, q_cos, q_sin, k_cos, k_sin = ctx.saved_tensors
        shape, dtype, q_per_group = ctx.layout
        dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
        d_mixed = torch.empty(shape, dtype=dtype, device=dq.device)
        dq_slots, dk_slots, dv_slots = qkv_slots(d_mixed, q_per_group)
        for b in range(shape[1]):  # dq [s, heads, d] into [s, groups, q_per_group, d]
            rotate_transpose_sum([dq[:, b]], [positions[0]], q_cos, q_sin, dq_slots[:, b])
            rotate_transpose_sum([dk[:, b]], [positions[0]], k_cos, k_sin, dk_slots[:, b])
            # dv as it is: a vectorised copy into its strided slots (torch's copy_ into that
            # layout is a slow unvectorised kernel)
            rotate_transpose_sum([dv[:, b]], None, q_cos, q_sin, dv_slots[:, b])
        return d_mixed, None, None, None


def fused_apply_qkv_rotary_pos_emb(
        mixed_qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
        qkv_split_arg_list: list[int], tensor_format: str = "sbhd", interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused QKV output [s, b, groups, (q_per_group + 2) * d] split into q [s, b,
    heads, d] and k rotated by their [s, 1, 1, d] tables, and v (Transformer Engine's
    signature)."""
    if tensor_format != "sbhd" or interleaved:
        raise ValueError("the fused QKV RoPE supports the sbhd format and the rotate-half layout "
                         "only; use trainer.fused_rope=false")
    q_width, head_dim, v_dim = qkv_split_arg_list
    if head_dim != v_dim or q_width % head_dim:
        raise ValueError(f"the fused QKV RoPE needs whole query heads and k, v of one head dim, "
                         f"got the split {qkv_split_arg_list}")
    s = mixed_qkv.shape[0]
    q_tables = _half_tables(q_freqs[:s], head_dim)
    k_tables = q_tables if k_freqs is q_freqs else _half_tables(k_freqs[:s], head_dim)
    return _QKVRotate.apply(mixed_qkv, q_tables, k_tables, q_width // head_dim)


def install() -> None:
    """Fill megatron's fused-RoPE slots with ours where Transformer Engine left them empty
    (megatron's config validation refuses `apply_rope_fusion` while they are None, and its
    attention takes the fused QKV path only with HAVE_FUSED_QKV_ROPE)."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
    if not megatron_attention.HAVE_FUSED_QKV_ROPE:
        megatron_attention.apply_fused_qkv_rotary_pos_emb = fused_apply_qkv_rotary_pos_emb
        megatron_attention.HAVE_FUSED_QKV_ROPE = True
