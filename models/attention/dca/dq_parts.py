"""DCA's backward kernel leaves dQ per part: the gradients of each part's rotated queries, in
float32 accumulators laid out as FA4's SM90 backward keeps them (`fa4_sm90_rows`). The true dq
is the sum over the parts of each one rotated back (a rotation's transpose: sin negated), times
the part's logit factors, times the softmax scale:

    dq_i = scale * sum_p f_p(i) R(pos_p(i))^T dQ_p[i]

`rotate_back` does that in one pass, in place of FA4's postprocess per part: on CUDA a Triton
kernel that reads every part's accumulator once (contiguously, reordered in registers) and
writes dq once, rounding once; elsewhere torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.attention.dca.plan import KERNEL_HEAD_DIMS
from models.attention.rope import apply_rope, half_tables, head_layout, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used instead.
    triton = None




class DQParts(NamedTuple):
    """Per-part dQ of the rotated queries, unscaled: data [parts * b, h, n * d] (part-major),
    each (part, sequence, head)'s n * d values in `layout`: "rows" (row-major [n, d]) or
    "fa4_sm90" (FA4's SM90 backward accumulator; `fa4_sm90_rows`)."""
    data: torch.Tensor
    layout: str


def fa4_sm90_rows(data: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., n * d] in FA4's SM90 dQ accumulator order -> [..., n, d] (a copy), for the head
    dims KERNEL_HEAD_DIMS.

    FA4's SM90 backward computes dQ in 64-row WGMMA fragments (a warpgroup's thread t holds
    value i at row 16 (t // 32) + 8 ((i // 2) % 2) + (t % 32) // 4, column 8 (i // 4) +
    2 (t % 4) + i % 2), copies each warpgroup's fragment to shared memory in register order,
    four floats per thread side by side, and adds that block to the accumulator as it is. At
    these head dims every 64 rows take 64 * d values, the first half of the columns before the
    second, each half ordered (column / 8, warp, lane / 4, lane % 4, (i // 2) % 2, i % 2).
    """
    groups = data.shape[-1] // (64 * dim)
    blocks = data.reshape(*data.shape[:-1], groups, 2, dim // 16, 4, 8, 4, 2, 2)
    lead = data.dim() - 1
    # (half, col/8, warp, lane/4, lane%4, row+8, col%2) -> rows (warp, row+8, lane/4) and
    # columns (half, col/8, lane%4, col%2)
    order = [*range(lead + 1), lead + 3, lead + 6, lead + 4, lead + 1, lead + 2, lead + 5,
             lead + 7]
    return blocks.permute(order).reshape(*data.shape[:-1], groups * 64, dim)


def rotate_back(dq_parts: DQParts, positions: torch.Tensor, cos_half: torch.Tensor,
                sin_half: torch.Tensor, factors: torch.Tensor | None, scale: float,
                out: torch.Tensor) -> None:
    """out [b, n, h, d] = scale * sum_p factors[p] R(positions[p])^T dQ_p, in place.

    positions: [parts, n] int32 rows of the [P, d/2] half tables, -1 where a part's
    accumulator holds no gradient for the row (its values there are never read: the kernels
    never wrote them, nor were they zeroed); factors: [parts, n] logit factors, or None (all
    1); both with a unit last stride. out may be a view with a unit last stride, also [b, n,
    groups, heads_per_group, d] (heads in groups, as in megatron's fused QKV projection: the
    groups' heads in order). Layout "fa4_sm90" needs n a multiple of 64 and d in
    KERNEL_HEAD_DIMS."""
    parts = positions.shape[0]
    batch, rows, heads, dim = out.shape[0], out.shape[1], out.shape[2:-1].numel(), out.shape[-1]
    if dq_parts.data.shape != (parts * batch, heads, rows * dim):
        raise ValueError(f"dQ parts {tuple(dq_parts.data.shape)} do not fit {parts} parts of "
                         f"dq {tuple(out.shape)}")
    if dq_parts.layout == "fa4_sm90" and (rows % 64 or dim not in KERNEL_HEAD_DIMS):
        raise ValueError(f"FA4's SM90 dQ layout needs rows ({rows}) a multiple of 64 and "
                         f"head_dim ({dim}) one of {KERNEL_HEAD_DIMS}")
    if dq_parts.layout != "fa4_sm90" or not use_triton(dq_parts.data):
        _rotate_back_torch(dq_parts, positions, cos_half, sin_half, factors, scale, out)
        return
    half = dim // 2
    per_group, group_stride, head_stride = head_layout(out, 2)
    _rotate_back_kernel[(rows // 64, heads, batch)](
        dq_parts.data, positions, cos_half, sin_half,
        factors if factors is not None else cos_half, out,
        batch, per_group, dq_parts.data.stride(0), dq_parts.data.stride(1), positions.stride(0),
        cos_half.stride(0), factors.stride(0) if factors is not None else 0, out.stride(0),
        out.stride(1), group_stride, head_stride, scale,
        PARTS=parts, DIM=dim, HALF=half, COL8=triton.next_power_of_2(half // 8),
        FACTORS=factors is not None, num_warps=4,
    )


def _rotate_back_torch(dq_parts: DQParts, positions: torch.Tensor, cos_half: torch.Tensor,
                       sin_half: torch.Tensor, factors: torch.Tensor | None, scale: float,
                       out: torch.Tensor) -> None:
    parts = positions.shape[0]
    batch, rows, heads, dim = out.shape[0], out.shape[1], out.shape[2:-1].numel(), out.shape[-1]
    data = dq_parts.data.view(parts, batch, heads, rows * dim)
    grads = (fa4_sm90_rows(data, dim) if dq_parts.layout == "fa4_sm90"
             else data.view(parts, batch, heads, rows, dim))
    grads = grads.transpose(2, 3).to(cos_half.dtype) * scale  # [p, b, n, h, d]
    total = torch.zeros(batch, rows, heads, dim, dtype=cos_half.dtype, device=out.device)
    for p in range(parts):
        used = positions[p] >= 0
        grad = torch.where(used[None, :, None, None], grads[p], 0)  # unused rows: unspecified
        if factors is not None:
            grad = grad * factors[p, None, :, None, None]
        cos, sin = half_tables(cos_half, sin_half, positions[p].clamp(min=0))
        total += apply_rope(grad, cos, -sin)  # R^T: the rotation with sin negated
    out.copy_(total.view(out.shape))


if triton is not None:

    @triton.jit
    def _fa4_sm90_half(ptr, read, COL8: tl.constexpr, HALF: tl.constexpr):
        # One half of a 64-row group in FA4's order (fa4_sm90_rows), as [64, 8 * COL8] rows
        # and columns, or zeros where `read` is false; columns from HALF on are padding (COL8 =
        # HALF / 8 rounded up to a power of two, the values past the half masked).
        j = tl.arange(0, COL8 * 512)
        x = tl.load(ptr + j, mask=(j < HALF * 64) & read, other=0.0)  # contiguous, coalesced
        x = tl.reshape(x, (COL8, 4, 8, 4, 2, 2))  # (col/8, warp, lane/4, lane%4, +8, col%2)
        x = tl.permute(x, (1, 4, 2, 0, 3, 5))
        return tl.reshape(x, (64, COL8 * 8))

    @triton.jit
    def _rotate_back_kernel(data_ptr, pos_ptr, cos_ptr, sin_ptr, factor_ptr, out_ptr,
                            B, PER_GROUP, s_data_bp, s_data_h, s_pos, s_tab, s_factor,
                            s_out_b, s_out_s, s_out_g, s_out_h, scale, PARTS: tl.constexpr,
                            DIM: tl.constexpr, HALF: tl.constexpr, COL8: tl.constexpr,
                            FACTORS: tl.constexpr):
        # One program: 64 rows of one head of one sequence, every part.
        group = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        row = group * 64 + tl.arange(0, 64)  # in the sequence piece
        c = tl.arange(0, COL8 * 8)  # column in the first half
        ok = (c < HALF)[None, :]
        acc1 = tl.zeros((64, COL8 * 8), dtype=tl.float32)
        acc2 = tl.zeros((64, COL8 * 8), dtype=tl.float32)
        for p in tl.static_range(PARTS):
            pos = tl.load(pos_ptr + p * s_pos + row).to(tl.int64)
            used = pos >= 0  # -1: a row this part's accumulator does not hold
            read = tl.max(used.to(tl.int32), axis=0) > 0  # the group holds some row of it
            base = data_ptr + (p * B + b) * s_data_bp + head * s_data_h + group * (64 * DIM)
            g1 = tl.where(used[:, None], _fa4_sm90_half(base, read, COL8, HALF), 0.0)
            g2 = tl.where(used[:, None], _fa4_sm90_half(base + HALF * 64, read, COL8, HALF),
                          0.0)
            tab = pos[:, None] * s_tab + c[None, :]
            cos = tl.load(cos_ptr + tab, mask=ok & used[:, None], other=0.0)
            sin = tl.load(sin_ptr + tab, mask=ok & used[:, None], other=0.0)
            if FACTORS:
                f = tl.load(factor_ptr + p * s_factor + row).to(tl.float32)[:, None]
                cos = cos * f
                sin = sin * f
            acc1 += g1 * cos + g2 * sin  # R^T g: (g1 c + g2 s, g2 c - g1 s)
            acc2 += g2 * cos - g1 * sin
        # out's heads in groups of PER_GROUP (one group: PER_GROUP heads, s_out_g unused)
        o_head = (head // PER_GROUP) * s_out_g + (head % PER_GROUP) * s_out_h
        o_off = b * s_out_b + row[:, None] * s_out_s + o_head + c[None, :]
        tl.store(out_ptr + o_off, (acc1 * scale).to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + o_off + HALF, (acc2 * scale).to(out_ptr.dtype.element_ty), mask=ok)
