"""`rotate_multi` and `rotate_transpose_sum` (DCA's rotations) on the torch path, float64:
against the shared reference rotation and its transpose."""

from __future__ import annotations

import pytest
import torch

from models.attention.rope import head_layout, rope_cos_sin, rotate_multi, rotate_transpose_sum
from tests.reference import rope_rotate


def _tables(rows: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(torch.arange(rows), d, dtype=torch.float64)
    return cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()


def test_rotate_multi_is_the_rotation_at_each_position_set() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, 8, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 16, (3, 9), generator=gen, dtype=torch.int32)
    cos, sin = _tables(16, 8)
    out = rotate_multi(x, positions, cos, sin)
    for i in range(3):
        assert torch.allclose(out[i], rope_rotate(x, positions[i].long()), atol=1e-12)


@pytest.mark.parametrize("accumulate", [False, True])
def test_rotate_transpose_sum_is_the_gradient_of_the_rotations(accumulate: bool) -> None:
    """sum_i R(p_i)^T g_i is the vjp of x -> (R(p_i) x)_i (autograd through the reference),
    added to out's previous value when accumulating."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    positions = [torch.randint(0, 16, (9,), generator=gen, dtype=torch.int32) for _ in range(3)]
    grads = [torch.randn(9, 3, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    rotated = [rope_rotate(x[None], p.long())[0] for p in positions]
    expected = torch.autograd.grad(rotated, x, grads)[0]
    before = torch.randn(9, 3, 8, generator=gen, dtype=torch.float64)
    out = before.clone()
    cos, sin = _tables(16, 8)
    rotate_transpose_sum(grads, positions, cos, sin, out, accumulate=accumulate)
    assert torch.allclose(out, expected + before if accumulate else expected, atol=1e-12)
    plain = before.clone()
    rotate_transpose_sum(grads[:2], None, cos, sin, plain, accumulate=accumulate)
    assert torch.allclose(plain, grads[0] + grads[1] + (before if accumulate else 0), atol=1e-12)


def test_head_layout_of_heads_in_groups() -> None:
    """The (heads per group, group stride, head stride) the kernels address heads by: one group
    for [.., h, d], megatron's groups for its fused QKV's query view [.., groups, g, d]."""
    fused = torch.zeros(2, 5, 4, (3 + 2) * 8)  # [b, s, groups, (g + 2) d], g = 3, d = 8
    q = fused[..., :24].unflatten(-1, (3, 8))  # [b, s, 4, 3, 8]
    assert head_layout(q, 2) == (3, 40, 8)
    assert head_layout(q[0], 1) == (3, 40, 8)
    assert head_layout(fused[..., 24:32], 2) == (4, 0, 40)  # k: one group of 4 heads
