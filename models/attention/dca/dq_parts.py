"""DCA's backward kernel leaves dQ per part: the gradients of each part's rotated queries, in
float32 accumulators laid out as FA4's SM90 backward keeps them (fa4_backward.dq_tile). The
true dq is the sum over the parts of each one rotated back (a rotation's transpose: sin
negated), times the part's logit factors, times the softmax scale:

    dq_i = scale * sum_p f_p(i) R(pos_p(i))^T dQ_p[i]

`rotate_back` does that in one pass: on CUDA a Triton kernel that reads every part's
accumulator once (through the tile map) and writes dq once, rounding once; elsewhere torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.attention.rope import apply_rope, half_tables, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used instead.
    triton = None


class DQParts(NamedTuple):
    """Per-part dQ of the rotated queries, unscaled: data [parts * b, h, n * d] (part-major),
    each run of tile_m rows one block of tile_m * d values in which row r, column c of the
    block sits at tile[r, c] (tile: [tile_m, d] int64 on data's device)."""
    data: torch.Tensor
    tile: torch.Tensor


def rotate_back(dq_parts: DQParts, positions: torch.Tensor, cos_half: torch.Tensor,
                sin_half: torch.Tensor, factors: torch.Tensor | None, scale: float,
                out: torch.Tensor) -> None:
    """out [b, n, h, d] = scale * sum_p factors[p] R(positions[p])^T dQ_p, in place.

    positions: [parts, n] int32 rows of the [P, d/2] half tables (a unit last stride);
    factors: [parts, n] logit factors, or None (all 1). out may be a view with a unit last
    stride; n must be a multiple of tile_m."""
    parts = positions.shape[0]
    batch, rows, heads, dim = out.shape
    tile_m = dq_parts.tile.shape[0]
    if rows % tile_m or dq_parts.data.shape != (parts * batch, heads, rows * dim):
        raise ValueError(f"dQ parts {tuple(dq_parts.data.shape)} (tiles of {tile_m} rows) do "
                         f"not fit {parts} parts of dq {tuple(out.shape)}")
    if not use_triton(dq_parts.data):
        _rotate_back_torch(dq_parts, positions, cos_half, sin_half, factors, scale, out)
        return
    half = dim // 2
    grid = (rows // tile_m, heads, batch)
    _rotate_back_kernel[grid](
        dq_parts.data, dq_parts.tile, positions, cos_half, sin_half,
        factors if factors is not None else cos_half, out,
        batch, dq_parts.data.stride(0), dq_parts.data.stride(1), dq_parts.tile.stride(0),
        positions.stride(0), cos_half.stride(0),
        factors.stride(0) if factors is not None else 0, out.stride(0), out.stride(1),
        out.stride(2), scale,
        PARTS=parts, DIM=dim, HALF=half, TILE_M=tile_m, BLOCK_D=triton.next_power_of_2(half),
        FACTORS=factors is not None, num_warps=8,
    )


def _rotate_back_torch(dq_parts: DQParts, positions: torch.Tensor, cos_half: torch.Tensor,
                       sin_half: torch.Tensor, factors: torch.Tensor | None, scale: float,
                       out: torch.Tensor) -> None:
    parts = positions.shape[0]
    batch, rows, heads, dim = out.shape
    tile_m = dq_parts.tile.shape[0]
    blocks = dq_parts.data.view(parts, batch, heads, rows // tile_m, tile_m * dim)
    grads = blocks[..., dq_parts.tile.flatten()].view(parts, batch, heads, rows, dim)
    grads = grads.transpose(2, 3).to(cos_half.dtype) * scale  # [p, b, n, h, d]
    total = torch.zeros(out.shape, dtype=cos_half.dtype, device=out.device)
    for p in range(parts):
        grad = grads[p] if factors is None else grads[p] * factors[p, None, :, None, None]
        cos, sin = half_tables(cos_half, sin_half, positions[p])
        total += apply_rope(grad, cos, -sin)  # R^T: the rotation with sin negated
    out.copy_(total)


if triton is not None:

    @triton.jit
    def _rotate_back_kernel(data_ptr, tile_ptr, pos_ptr, cos_ptr, sin_ptr, factor_ptr, out_ptr,
                            B, s_data_bp, s_data_h, s_tile, s_pos, s_tab, s_factor, s_out_b,
                            s_out_s, s_out_h, scale, PARTS: tl.constexpr, DIM: tl.constexpr,
                            HALF: tl.constexpr, TILE_M: tl.constexpr, BLOCK_D: tl.constexpr,
                            FACTORS: tl.constexpr):
        # One program: one tile of TILE_M rows of one head of one sequence, every part.
        block = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        r = tl.arange(0, TILE_M)  # row in the tile
        c = tl.arange(0, BLOCK_D)  # column in the first half
        ok = (c < HALF)[None, :]
        t_off = r[:, None] * s_tile + c[None, :]
        lo = tl.load(tile_ptr + t_off, mask=ok, other=0)  # [TM, BD] offsets in the tile
        hi = tl.load(tile_ptr + t_off + HALF, mask=ok, other=0)
        row = block * TILE_M + r  # in the sequence piece
        acc1 = tl.zeros((TILE_M, BLOCK_D), dtype=tl.float32)
        acc2 = tl.zeros((TILE_M, BLOCK_D), dtype=tl.float32)
        for p in tl.static_range(PARTS):
            base = (data_ptr + (p * B + b) * s_data_bp + head * s_data_h
                    + block * (TILE_M * DIM))
            g1 = tl.load(base + lo, mask=ok, other=0.0)
            g2 = tl.load(base + hi, mask=ok, other=0.0)
            pos = tl.load(pos_ptr + p * s_pos + row).to(tl.int64)
            tab = pos[:, None] * s_tab + c[None, :]
            cos = tl.load(cos_ptr + tab, mask=ok, other=0.0)
            sin = tl.load(sin_ptr + tab, mask=ok, other=0.0)
            if FACTORS:
                f = tl.load(factor_ptr + p * s_factor + row).to(tl.float32)[:, None]
                cos = cos * f
                sin = sin * f
            acc1 += g1 * cos + g2 * sin  # R^T g: (g1 c + g2 s, g2 c - g1 s)
            acc2 += g2 * cos - g1 * sin
        o_off = b * s_out_b + row[:, None] * s_out_s + head * s_out_h + c[None, :]
        tl.store(out_ptr + o_off, (acc1 * scale).to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + o_off + HALF, (acc2 * scale).to(out_ptr.dtype.element_ty), mask=ok)
