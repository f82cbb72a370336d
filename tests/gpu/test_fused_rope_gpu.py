"""Fused RoPE's Triton path (models/fused_rope.py) in bf16 against float64 truth: at least as
accurate as megatron's unfused RoPE (which rounds cos/sin and each product to bf16), forward and
backward, for q as megatron holds it (a strided slice of the fused QKV projection), and the
fused QKV split (its query heads read and its gradient written in their groups)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from models.fused_rope import (
    fused_apply_qkv_rotary_pos_emb,
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
)
from tests.models.test_fused_rope import megatron_split

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _freqs(seq: int, dim: int, theta: float = 500000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cuda") / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device="cuda"), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's layout


def _error(x: torch.Tensor, truth: torch.Tensor) -> float:
    return float((x.detach().double() - truth).abs().max())


@pytest.mark.parametrize("seq", [4096, 32768])
def test_bf16_is_at_least_as_accurate_as_megatrons_unfused_rope(seq: int) -> None:
    b, h, d = 1, 16, 128
    freqs = _freqs(seq, d)
    qkv = torch.randn(seq, b, h, 3 * d, device="cuda", dtype=torch.bfloat16)
    x = qkv[..., :d]  # strided, as megatron's q
    grad = torch.randn(seq, b, h, d, device="cuda", dtype=torch.bfloat16)
    leaf64 = x.double().requires_grad_()
    truth = rope_utils._apply_rotary_pos_emb_bshd(leaf64, freqs.double())
    truth.backward(grad.double())
    outs, grads = [], []
    for fn in (fused_apply_rotary_pos_emb, rope_utils._apply_rotary_pos_emb_bshd):
        leaf = x.detach().clone().requires_grad_()
        out = fn(leaf, freqs)
        out.backward(grad)
        outs.append(_error(out, truth.detach()))
        grads.append(_error(leaf.grad, leaf64.grad))
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
    fused_out, unfused_out = outs
    fused_grad, unfused_grad = grads
    assert fused_out <= unfused_out * 1.01 + 1e-6, outs
    assert fused_grad <= unfused_grad * 1.01 + 1e-6, grads
    assert fused_out < 0.05  # |x| < ~5: a few bf16 ulps at most


def test_packed_sequences_on_the_gpu_match_the_cpu_fallback() -> None:
    h, d = 4, 64
    cu = torch.tensor([0, 100, 1000, 4096], dtype=torch.int32, device="cuda")
    freqs = _freqs(4096, d)
    x = torch.randn(4096, h, d, device="cuda", dtype=torch.float32, requires_grad=True)
    out = fused_apply_rotary_pos_emb_thd(x, cu, freqs)
    out.backward(torch.ones_like(out))
    cpu = x.detach().cpu().requires_grad_()
    ref = fused_apply_rotary_pos_emb_thd(cpu, cu.cpu(), freqs.cpu())
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.cpu(), cpu.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq", [4096, 32768])
def test_fused_qkv_split_in_bf16_is_as_accurate_as_megatrons(seq: int) -> None:
    """gpt_1p3b's layout (4 groups of 4 query heads, head dim 128): q, k, v and the fused
    gradient against float64, at least as close as megatron's own split and RoPE in bf16."""
    groups, q_per_group, d = 4, 4, 128
    split = [q_per_group * d, d, d]
    freqs = _freqs(seq, d)
    mixed = torch.randn(seq, 1, groups, sum(split), device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(seq, 1, groups * n, d, device="cuda", dtype=torch.bfloat16)
             for n in (q_per_group, 1, 1)]
    leaf64 = mixed.double().requires_grad_()
    truth = megatron_split(leaf64, freqs.double(), split)
    torch.autograd.backward(truth, [g.double() for g in grads])
    errors = []
    for fn in (lambda m: fused_apply_qkv_rotary_pos_emb(m, freqs, freqs, split),
               lambda m: megatron_split(m, freqs, split)):
        leaf = mixed.clone().requires_grad_()
        out = fn(leaf)
        torch.autograd.backward(out, grads)
        assert all(o.dtype == torch.bfloat16 and o.shape == t.shape for o, t in zip(out, truth))
        errors.append([_error(o, t.detach()) for o, t in zip(out, truth)]
                      + [_error(leaf.grad, leaf64.grad)])
    fused, megatron = errors
    assert all(f <= m * 1.01 + 1e-6 for f, m in zip(fused, megatron)), errors
    assert max(fused) < 0.05, errors


@pytest.mark.parametrize("q_per_group", [1, 4])
def test_fused_qkv_split_on_the_gpu_matches_the_cpu_fallback(q_per_group: int) -> None:
    """float32, batch 2, MHA and GQA: the Triton kernels' grouped head addressing (q read,
    the gradient's query slots written) against the torch path."""
    s, b, groups, d = 1000, 2, 3, 64
    split = [q_per_group * d, d, d]
    freqs = _freqs(s, d)
    mixed = torch.randn(s, b, groups, sum(split), device="cuda", requires_grad=True)
    grads = [torch.randn(s, b, groups * n, d, device="cuda") for n in (q_per_group, 1, 1)]
    out = fused_apply_qkv_rotary_pos_emb(mixed, freqs, freqs, split)
    torch.autograd.backward(out, grads)
    cpu = mixed.detach().cpu().requires_grad_()
    ref = fused_apply_qkv_rotary_pos_emb(cpu, freqs.cpu(), freqs.cpu(), split)
    torch.autograd.backward(ref, [g.cpu() for g in grads])
    for a, r in zip(out, ref):
        torch.testing.assert_close(a.cpu(), r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed.grad.cpu(), cpu.grad, rtol=1e-5, atol=1e-5)
