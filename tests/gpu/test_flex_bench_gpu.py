"""bench.attention's flex row on the GPU: the compiled flex kernel computes causal attention and
its gradients (against a float64 reference), so its speed is a fair ceiling for Triton."""

from __future__ import annotations

import pytest
import torch

from bench import attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_compiled_flex_matches_float64_causal_attention(kv_heads: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1024, h, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for h in (8, kv_heads, kv_heads))  # [b, s, h, d]
    dout = torch.randn_like(q)
    out = attention.REGISTRY["flex"](None).fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2), is_causal=True,
        enable_gqa=kv_heads != 8).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert _rel_err(out, ref) < 1e-2
    for got, want in zip(grads, ref_grads):
        assert _rel_err(got, want) < 1e-2
