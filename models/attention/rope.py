"""Rotary position embeddings: megatron's default rotate-half convention over the full head dim.

`rope_cos_sin` and `apply_rope` are the plain helpers. `rotate_multi` and `rotate_transpose_sum`
serve Dual Chunk Attention, which rotates each query to several position sets: on CUDA they are
single fused Triton passes (read x once, write every rotation; read every gradient once, write
their sum), elsewhere plain torch. Cos and sin are scaled by `mscale` (megatron's YaRN
convention), so logits scale by mscale^2.

The transpose of a rotation R(p) (cos, sin at position p, both times mscale) is the same formula
with sin negated: R(p)^T x = x * cos - rotate_half(x) * sin. Backward passes use exactly that.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from models.rope_scaling import RopeScaling, rope_frequencies

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch paths below are used instead.
    triton = None


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
                 mscale: float = 1.0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer `positions` [...] -> two [..., head_dim] tensors.

    `scaling` sets the frequencies' context scaling (models/rope_scaling.py; its attention
    factor is the caller's `mscale`).

    Both halves of the last dim repeat the same angles (rotate-half layout). Angles are computed
    in float32, or float64 when `dtype` is float64, then scaled by `mscale` and cast to `dtype`.
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    device = positions.device if device is None else device
    inv_freq, _ = rope_frequencies(head_dim, theta, scaling, dtype=compute, device=device)  # [d/2]
    angles = positions.to(device=device, dtype=compute)[..., None] * inv_freq  # [..., d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., d]
    return (angles.cos() * mscale).to(dtype), (angles.sin() * mscale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, h, d] by cos, sin of shape [s, d] or [b, s, d]; returns x's dtype.

    The arithmetic runs in the wider of x's and the tables' dtypes (float32 tables keep bf16
    inputs from rounding twice).
    """
    cos = cos.unsqueeze(-2) if cos.dim() == 3 else cos[None, :, None, :]  # [b|1, s, 1, d]
    sin = sin.unsqueeze(-2) if sin.dim() == 3 else sin[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def use_triton(x: torch.Tensor) -> bool:
    """Fused kernels on CUDA (or under Triton's CPU interpreter); float64 stays in torch."""
    if triton is None or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def half_tables(cos_half: torch.Tensor, sin_half: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather full-width [n, d] cos/sin rows for `positions` from [P, d/2] half tables."""
    cos = cos_half[positions]
    sin = sin_half[positions]
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def rotate_multi(x: torch.Tensor, positions: torch.Tensor, cos_half: torch.Tensor,
                 sin_half: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, h, d] to several position sets in one pass.

    x may also be [b, s, groups, heads_per_group, d], the heads of megatron's fused QKV
    projection in their groups (whose head strides differ within and across groups): its heads
    are then the groups' heads in order. positions: [n, s] integer rows of the tables, or -1
    where a rotation's row is not needed (left unwritten on CUDA, unspecified elsewhere);
    cos_half, sin_half: [P, d/2] (first half of `rope_cos_sin`'s output). Returns a contiguous
    [n, b, s, h, d] tensor in x's dtype, so each rotation `out[i]` is itself contiguous (the
    layout the chunk-batched kernels view for free).
    """
    n = positions.shape[0]
    b, s, h, d = x.shape[0], x.shape[1], x.shape[2:-1].numel(), x.shape[-1]
    out = torch.empty((n, b, s, h, d), dtype=x.dtype, device=x.device)
    if not use_triton(x):
        x = x.reshape(b, s, h, d)
        for i in range(n):
            cos, sin = half_tables(cos_half, sin_half, positions[i].clamp(min=0))
            out[i] = apply_rope(x, cos, sin)
        return out
    pos = positions.to(torch.int32).contiguous()
    per_group, group_stride, head_stride = head_layout(x, 2)
    block_h, block_d, block_s = _blocks(h, d)
    grid = (triton.cdiv(s, block_s), b)
    _rotate_multi_kernel[grid](
        x, out, pos, cos_half, sin_half, s, h, per_group,
        x.stride(0), x.stride(1), group_stride, head_stride, out.stride(0), out.stride(1),
        out.stride(2), out.stride(3), pos.stride(0), cos_half.stride(0),
        NUM_OUT=n, HALF=d // 2, BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=_WARPS,
    )
    return out


# Warps of a rotation kernel's program; `_blocks` sizes the program to 8 elements a thread.
_WARPS = 8


def _blocks(heads: int, head_dim: int) -> tuple[int, int, int]:
    """(heads, half dims, tokens) of one program of the rotation kernels: every head, and
    tokens for ~2048 elements of each half, 8 a thread at _WARPS (at 32K, 16 heads of 128, of
    1-8 tokens at 4 or 8 warps the fastest had 8 elements a thread, on the H100)."""
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim // 2)
    return block_h, block_d, max(1, 2048 // (block_h * block_d))


def head_layout(x: torch.Tensor, token_dims: int) -> tuple[int, int, int]:
    """(heads per group, group stride, head stride) of x's head dims, those after its first
    `token_dims`: [.., h, d] is one group of h heads; [.., groups, heads_per_group, d] holds its
    heads in groups (megatron's fused QKV layout)."""
    if x.dim() == token_dims + 3:
        return x.shape[-2], x.stride(-3), x.stride(-2)
    return x.shape[-2], 0, x.stride(-2)


def rotate_transpose_sum(grads: list[torch.Tensor], positions: list[torch.Tensor] | None,
                         cos_half: torch.Tensor, sin_half: torch.Tensor,
                         out: torch.Tensor, accumulate: bool = False) -> None:
    """out[...] = sum_i R(positions[i])^T grads[i]: the gradient through several rotations.

    grads: 1 to 3 [s, h, d] tensors (any strides with a unit last stride, any float dtype,
    summed in float32 or float64); positions: matching contiguous [s] int32 rows of the tables,
    or None for a plain sum; out: [s, h, d], written in place, or added to (`accumulate`: out
    joins the sum before its one rounding), or [s, groups, heads_per_group, d] (the query slots
    of megatron's fused QKV gradient; not accumulated), its heads the groups' in order. out may
    be grads[0] itself (each row is read before it is written).
    """
    if not 1 <= len(grads) <= 3:
        raise ValueError(f"rotate_transpose_sum takes 1 to 3 gradients, got {len(grads)}")
    if out.dim() == 4 and accumulate:
        raise ValueError("rotate_transpose_sum accumulates into [s, h, d] outputs only")
    s, h, d = out.shape[0], out.shape[1:-1].numel(), out.shape[-1]
    if not use_triton(out):
        acc = (out.to(cos_half.dtype) if accumulate
               else torch.zeros((s, h, d), dtype=cos_half.dtype, device=out.device))
        for i, g in enumerate(grads):
            if positions is None:
                acc += g
            else:
                cos, sin = half_tables(cos_half, sin_half, positions[i])
                acc += apply_rope(g.unsqueeze(0).to(acc.dtype), cos, -sin)[0]  # [s, h, d]
        out.copy_(acc.view(out.shape))
        return
    per_group, group_stride, head_stride = head_layout(out, 1)
    g = list(grads) + [grads[0]] * (3 - len(grads))  # unused slots: never read (NUM_IN)
    p = [cos_half] if positions is None else list(positions)  # cos_half: never read
    p = p + [p[0]] * (3 - len(p))
    block_h, block_d, block_s = _blocks(h, d)
    _rotate_transpose_sum_kernel[(triton.cdiv(s, block_s),)](
        g[0], g[1], g[2], p[0], p[1], p[2], cos_half, sin_half, out, s, h, per_group,
        g[0].stride(0), g[0].stride(1), g[1].stride(0), g[1].stride(1),
        g[2].stride(0), g[2].stride(1), out.stride(0), group_stride, head_stride,
        cos_half.stride(0),
        NUM_IN=len(grads), ROTATE=positions is not None, ACCUMULATE=accumulate, HALF=d // 2,
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_WARPS,
    )


class _Rotate(torch.autograd.Function):
    """x [b, s, h, d] -> R(positions) x in one pass; the backward applies the transposed
    rotation (`rotate_transpose_sum` of one gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, positions: torch.Tensor, cos_half: torch.Tensor,
                sin_half: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions, cos_half, sin_half)
        return rotate_multi(x, positions[None], cos_half, sin_half)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        positions, cos_half, sin_half = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        dx = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        for b in range(grad.shape[0]):
            rotate_transpose_sum([grad[b]], [positions], cos_half, sin_half, dx[b])
        return dx, None, None, None


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_half: torch.Tensor,
           sin_half: torch.Tensor) -> torch.Tensor:
    """Differentiable RoPE of x [b, s, h, d] (any strides, unit last stride) at `positions`
    (contiguous [s] int32 rows of the [P, d/2] half tables): a contiguous [b, s, h, d]."""
    return _Rotate.apply(x, positions, cos_half, sin_half)


if triton is not None:

    @triton.jit
    def _rotate_multi_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, S, H, PER_GROUP,
                             sxb, sxs, sxg, sxh, son, sob, sos, soh, spn, stab,
                             NUM_OUT: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program: BLOCK_S tokens x all heads; x is read once for every rotation. x's
        # heads lie in groups of PER_GROUP (group stride sxg, head stride sxh within one).
        # Every byte is read or written once: loads evict first and stores stream (.cs), so
        # neither keeps L2 lines the next accesses never use.
        b = tl.program_id(1).to(tl.int64)
        tok = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)  # [BS]
        head = tl.arange(0, BLOCK_H)
        dim = tl.arange(0, BLOCK_D)
        tok_ok = tok < S
        mask = tok_ok[:, None, None] & (head < H)[None, :, None] & (dim < HALF)[None, None, :]
        x_head = (head // PER_GROUP) * sxg + (head % PER_GROUP) * sxh
        x_off = b * sxb + tok[:, None, None] * sxs + x_head[None, :, None] + dim[None, None, :]
        x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)  # [BS, BH, BD]
        x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        o_off = b * sob + tok[:, None, None] * sos + head[None, :, None] * soh + dim[None, None, :]
        tab_mask = tok_ok[:, None] & (dim < HALF)[None, :]
        for i in tl.static_range(NUM_OUT):
            pos = tl.load(pos_ptr + i * spn + tok, mask=tok_ok, other=-1).to(tl.int64)
            needed = pos >= 0  # -1: a row this rotation need not write
            t_off = pos[:, None] * stab + dim[None, :]
            t_mask = tab_mask & needed[:, None]
            c = tl.load(cos_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]  # [BS, 1, BD]
            sn = tl.load(sin_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
            y1 = x1 * c - x2 * sn
            y2 = x2 * c + x1 * sn
            o_mask = mask & needed[:, None, None]
            tl.store(out_ptr + i * son + o_off, y1.to(out_ptr.dtype.element_ty), mask=o_mask,
                     cache_modifier=".cs")
            tl.store(out_ptr + i * son + o_off + HALF, y2.to(out_ptr.dtype.element_ty),
                     mask=o_mask, cache_modifier=".cs")

    @triton.jit
    def _accumulate_transposed(acc1, acc2, g_ptr, sgs, sgh, pos_ptr, cos_ptr, sin_ptr, stab,
                               tok, head, dim, mask, tab_mask, tok_ok, ROTATE: tl.constexpr,
                               HALF: tl.constexpr):
        # R^T g: (g1 c + g2 s, g2 c - g1 s), the rotation by the negative angle.
        g_off = tok[:, None, None] * sgs + head[None, :, None] * sgh + dim[None, None, :]
        g1 = tl.load(g_ptr + g_off, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        g2 = tl.load(g_ptr + g_off + HALF, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        if ROTATE:
            pos = tl.load(pos_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
            t_off = pos[:, None] * stab + dim[None, :]
            c = tl.load(cos_ptr + t_off, mask=tab_mask, other=0.0)[:, None, :]
            sn = tl.load(sin_ptr + t_off, mask=tab_mask, other=0.0)[:, None, :]
            r1 = g1 * c + g2 * sn
            r2 = g2 * c - g1 * sn
        else:
            r1 = g1
            r2 = g2
        return acc1 + r1, acc2 + r2

    @triton.jit
    def _rotate_transpose_sum_kernel(g0_ptr, g1_ptr, g2_ptr, p0_ptr, p1_ptr, p2_ptr,
                                     cos_ptr, sin_ptr, out_ptr, S, H, PER_GROUP,
                                     s0s, s0h, s1s, s1h, s2s, s2h, sos, sog, soh, stab,
                                     NUM_IN: tl.constexpr, ROTATE: tl.constexpr,
                                     ACCUMULATE: tl.constexpr, HALF: tl.constexpr,
                                     BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                                     BLOCK_D: tl.constexpr):
        tok = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)  # [BS]
        head = tl.arange(0, BLOCK_H)
        dim = tl.arange(0, BLOCK_D)
        tok_ok = tok < S
        mask = tok_ok[:, None, None] & (head < H)[None, :, None] & (dim < HALF)[None, None, :]
        tab_mask = tok_ok[:, None] & (dim < HALF)[None, :]
        acc1 = tl.zeros((BLOCK_S, BLOCK_H, BLOCK_D), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_S, BLOCK_H, BLOCK_D), dtype=tl.float32)
        if ACCUMULATE:  # out joins the sum (each program reads its own rows before writing them)
            acc1, acc2 = _accumulate_transposed(acc1, acc2, out_ptr, sos, soh, p0_ptr, cos_ptr,
                                                sin_ptr, stab, tok, head, dim, mask, tab_mask,
                                                tok_ok, False, HALF)
        acc1, acc2 = _accumulate_transposed(acc1, acc2, g0_ptr, s0s, s0h, p0_ptr, cos_ptr,
                                            sin_ptr, stab, tok, head, dim, mask, tab_mask,
                                            tok_ok, ROTATE, HALF)
        if NUM_IN > 1:
            acc1, acc2 = _accumulate_transposed(acc1, acc2, g1_ptr, s1s, s1h, p1_ptr, cos_ptr,
                                                sin_ptr, stab, tok, head, dim, mask, tab_mask,
                                                tok_ok, ROTATE, HALF)
        if NUM_IN > 2:
            acc1, acc2 = _accumulate_transposed(acc1, acc2, g2_ptr, s2s, s2h, p2_ptr, cos_ptr,
                                                sin_ptr, stab, tok, head, dim, mask, tab_mask,
                                                tok_ok, ROTATE, HALF)
        # out's heads in groups of PER_GROUP, as _rotate_multi_kernel's x
        o_head = (head // PER_GROUP) * sog + (head % PER_GROUP) * soh
        o_off = tok[:, None, None] * sos + o_head[None, :, None] + dim[None, None, :]
        tl.store(out_ptr + o_off, acc1.to(out_ptr.dtype.element_ty), mask=mask,
                 cache_modifier=".cs")
        tl.store(out_ptr + o_off + HALF, acc2.to(out_ptr.dtype.element_ty), mask=mask,
                 cache_modifier=".cs")
