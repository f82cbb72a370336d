"""bench/attention.py's GPU timeline summary, and its flex row on CPU."""

from __future__ import annotations

import pytest
import torch

from bench import attention


def test_gpu_timeline_counts_overlap_once_and_names_the_gaps() -> None:
    # Two overlapping kernels (0-10, 5-12), then a 30 us gap before "b", a 3 us gap before "c".
    line = attention.gpu_timeline([(42.0, 50.0, "b"), (0.0, 10.0, "a"), (5.0, 12.0, "a2"),
                                   (53.0, 60.0, "c")])
    assert line.startswith("GPU: 4 kernels, busy 0.03 ms of 0.06 ms (45%); 2 idle gaps, 0.03 ms")
    assert line.endswith("largest: 30 us before b, 3 us before c")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_variant_is_causal_attention(kv_heads: int) -> None:
    # The flex row is only a ceiling for Triton kernels if it computes what cuDNN's row does
    # (the compiled kernel's gradients are checked in tests/gpu/test_flex_bench_gpu.py: flex
    # has no backward on CPU).
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 192, h, 32, dtype=torch.float64) for h in (4, kv_heads, kv_heads))
    out = attention.REGISTRY["flex"](None).fn(q, k, v)  # [b, s, h, d]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=kv_heads != 4).transpose(1, 2)
    torch.testing.assert_close(out, ref)
