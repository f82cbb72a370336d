"""The dQ accumulators of DCA's backward kernel (models/attention/dca/dq_parts.py,
fa4_backward.py), the CPU-checkable half: FA4's SM90 accumulator order against a second
formulation from its WGMMA fragment, `rotate_back` against the parts rotated one by one, and
which rows the accumulators zero and read. The Triton kernel runs in tests/gpu/test_fa4_gpu.py."""

from __future__ import annotations

import pytest
import torch

from models.attention.dca import dq_parts, fa4_backward
from models.attention.dca.dq_parts import DQParts, rotate_back
from models.attention.rope import apply_rope, rope_cos_sin


def _fa4_sm90_offsets(rows: int, dim: int) -> torch.Tensor:
    """[rows, d]: where FA4's SM90 backward adds dQ's (row, column) in its accumulator, written
    from its WGMMA fragment and shared-memory copy (one warpgroup per 64 rows and d columns, as
    a second formulation beside dq_parts.fa4_sm90_rows's reshape)."""
    thread = torch.arange(128)[:, None]
    value = torch.arange(64 * dim // 128)[None, :]
    row = 16 * (thread // 32) + thread % 32 // 4 + 8 * (value // 2 % 2)  # [128, values]
    col = 8 * (value // 4) + 2 * (thread % 4) + value % 2
    offsets = torch.empty(rows, dim, dtype=torch.int64)
    for group in range(rows // 64):
        offsets[group * 64 + row, col] = group * 64 * dim + value // 4 * 512 + thread * 4 + (
            value % 4)
    return offsets


@pytest.mark.parametrize("dim", dq_parts.KERNEL_HEAD_DIMS)
def test_fa4_sm90_rows_reads_the_fragment_order(dim: int) -> None:
    offsets = _fa4_sm90_offsets(128, dim)
    assert torch.equal(dq_parts.fa4_sm90_rows(torch.arange(128 * dim), dim), offsets)
    assert torch.equal(offsets.flatten().sort().values, torch.arange(128 * dim))


@pytest.mark.parametrize("layout", ["rows", "fa4_sm90"])
def test_rotate_back_matches_the_parts_rotated_one_by_one(layout: str) -> None:
    """dq_parts.rotate_back (torch) equals the sum of the parts rotated back one by one
    (rope.apply_rope with sin negated), times their factors and the scale, the parts given in
    row order or in FA4's accumulator order."""
    torch.manual_seed(0)
    parts, batch, rows, heads, dim = 3, 2, 128, 2, 64
    grads = torch.randn(parts, batch, rows, heads, dim, dtype=torch.float64)
    positions = torch.randint(0, 20, (parts, rows), dtype=torch.int32)
    cos, sin = rope_cos_sin(torch.arange(20), dim, dtype=torch.float64)
    factors = torch.rand(parts, rows, dtype=torch.float64)
    expected = sum(apply_rope(grads[p] * factors[p, None, :, None, None], cos[positions[p]],
                              -sin[positions[p]]) for p in range(parts)) * 0.5
    data = grads.flatten(0, 1).transpose(1, 2).reshape(parts * batch, heads, rows * dim)
    if layout == "fa4_sm90":
        ordered = torch.empty_like(data)
        ordered[..., _fa4_sm90_offsets(rows, dim).flatten()] = data
        data = ordered
    out = torch.empty(batch, rows, heads, dim, dtype=torch.float64)
    rotate_back(DQParts(data, layout), positions, cos[:, :dim // 2], sin[:, :dim // 2], factors,
                0.5, out)
    torch.testing.assert_close(out, expected)


def test_rotate_back_skips_the_rows_a_part_does_not_hold() -> None:
    """Rows at position -1 of a part leave that part out of the sum, whatever its accumulator
    holds there (the kernel never wrote it, nor was it zeroed)."""
    torch.manual_seed(0)
    parts, rows, heads, dim = 3, 128, 2, 64
    grads = torch.randn(parts, 1, rows, heads, dim, dtype=torch.float64)
    positions = torch.randint(0, 20, (parts, rows), dtype=torch.int32)
    held = torch.rand(rows) < 0.5
    positions[1, ~held] = -1
    grads[1, :, ~held] = torch.nan
    cos, sin = rope_cos_sin(torch.arange(20), dim, dtype=torch.float64)
    expected = sum(apply_rope(grads[p], cos[positions[p]], -sin[positions[p]])
                   for p in (0, 2))
    expected[:, held] += apply_rope(grads[1][:, held], cos[positions[1, held]],
                                    -sin[positions[1, held]])
    out = torch.empty(1, rows, heads, dim, dtype=torch.float64)
    data = grads.flatten(0, 1).transpose(1, 2).reshape(parts, heads, rows * dim)
    rotate_back(DQParts(data, "rows"), positions, cos[:, :dim // 2], sin[:, :dim // 2], None,
                1.0, out)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(("seq", "seq_k"), [(1024, 1024), (256, 1024), (384, 896)])
def test_dq_accumulators_are_zeroed_where_the_kernel_adds(
        seq: int, seq_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """fa4_backward's accumulators for queries that are the last s_q of s_k rows: intra and
    inter zeroed everywhere, the successive part in exactly the 64-row groups of each chunk's
    first successive_rows rows (L = 256, successive_rows = 128), the rest left as allocated
    (here NaN, so a zero there would show)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: empty(*shape, **kw).fill_(torch.nan))
    batch, heads, dim = 2, 3, 4
    accum = fa4_backward._zeroed_accumulators(3, batch, heads, seq, seq_k, dim, 256, 128,
                                              torch.device("cpu"))
    parts = accum.view(3, batch, heads, seq // 64, 64 * dim)
    assert not parts[0].any() and not parts[2].any()
    rows = torch.arange(seq_k - seq, seq_k, 64)  # each group's first row
    held = rows % 256 < 128
    assert not parts[1][:, :, held].any() and parts[1][:, :, ~held].isnan().all()
    groups = fa4_backward._successive_groups(seq, seq_k, 256, 128, torch.device("cpu"))
    assert torch.equal(groups, torch.nonzero(held).flatten())
    two_parts = fa4_backward._zeroed_accumulators(2, batch, heads, seq, seq_k, dim, 256, 128,
                                                  torch.device("cpu"))
    assert two_parts.shape == (2 * batch, heads, seq * dim) and not two_parts.any()
