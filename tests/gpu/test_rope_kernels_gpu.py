"""DCA's fused Triton rotations against their torch path (the CPU tests' subject), bf16 and
float32, strided inputs, one to three gradients, written or accumulated."""

from __future__ import annotations

import pytest
import torch

from models.attention.rope import rope_cos_sin, rotate_multi, rotate_transpose_sum

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _tables(rows: int, d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(torch.arange(rows), d, dtype=torch.float32)
    return cos[:, :d // 2].contiguous().to(device), sin[:, :d // 2].contiguous().to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_multi_matches_the_torch_path(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 300, 6, 128, device="cuda", dtype=dtype)[:, :, ::2]  # strided heads
    positions = torch.randint(0, 1025, (3, 300), device="cuda", dtype=torch.int32)
    ours = rotate_multi(x, positions, *_tables(1025, 128, "cuda"))
    ref = rotate_multi(x.cpu().float(), positions.cpu(), *_tables(1025, 128, "cpu"))
    rtol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5  # one rounding to bf16: <= 2^-9
    torch.testing.assert_close(ours.float().cpu(), ref, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("terms", [1, 2, 3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_rotate_transpose_sum_matches_the_torch_path(terms: int, accumulate: bool) -> None:
    torch.manual_seed(terms)
    grads = [torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
             .contiguous().transpose(0, 1) for _ in range(terms)]  # head-major memory
    positions = [torch.randint(0, 1025, (300,), device="cuda", dtype=torch.int32)
                 for _ in range(terms)]
    start = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    for rotate in (True, False):
        ours = start.clone()
        rotate_transpose_sum(grads, positions if rotate else None, *_tables(1025, 128, "cuda"),
                             ours, accumulate=accumulate)
        ref = start.cpu().float()
        rotate_transpose_sum([g.cpu().float() for g in grads],
                             [p.cpu() for p in positions] if rotate else None,
                             *_tables(1025, 128, "cpu"), ref, accumulate=accumulate)
        torch.testing.assert_close(ours.float().cpu(), ref, rtol=2 ** -8, atol=1e-5)  # one
        # bf16 rounding of the float32 sum (the start value is already bf16, so exact in both)
