"""Dual Chunk Attention's fused GPU path (cuDNN kernels, Triton rotations and merges) in bf16
against the float64 reference, and its memory growth: under trainer.attention_kernel=cudnn (the FA4
paths, part calls and one call, are test_fa4_gpu.py's)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.attention import kernels
from models.attention.dca import backward as dca_backward
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.scaling import DCAScaling
from tests.reference import document_ids, positions_in_document, rope_rotate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def cudnn_kernels() -> Iterator[None]:
    with kernels.using("cudnn"):
        yield


def dca_reference_by_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                          local_size: int, cu_seqlens: torch.Tensor | None = None,
                          part_factors: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Float64 DCA from its part table (models/attention/dca/attention.py): one rotated q per
    part, one dense softmax.

    `part_factors` [s, 3]: logit factor of query i on each part (the length-dependent scaling).
    Returns the output and its float64 CPU leaves (q, k, v). Rotations run on the CPU (the
    shared reference builds its tables there); the S x S work runs on the GPU in float64.
    """
    q, k, v = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    seq, groups = q.shape[1], q.shape[2] // k.shape[2]
    length = chunk_size - local_size
    if cu_seqlens is None:
        pos, doc = torch.arange(seq), torch.zeros(seq, dtype=torch.long)
    else:
        pos, doc = positions_in_document(cu_seqlens.cpu()), document_ids(cu_seqlens.cpu())
    n, r = pos // length, pos % length
    part_of = torch.where(n[:, None] == n[None, :], 0,  # [s_i, s_j]: which row of the table
                          torch.where(n[None, :] == n[:, None] - 1, 1, 2))
    q_pos = [r, torch.clamp(r + length, max=chunk_size),
             torch.full((seq,), min(2 * length - 1, chunk_size))]
    k_rot = rope_rotate(k, r).repeat_interleave(groups, dim=2).cuda()
    part_of = part_of.cuda()
    scores = torch.zeros(q.shape[0], q.shape[2], seq, seq, dtype=torch.float64, device="cuda")
    for part, qp in enumerate(q_pos):
        part_scores = torch.einsum("bihd,bjhd->bhij", rope_rotate(q, qp).cuda(), k_rot)
        if part_factors is not None:
            part_scores = part_scores * part_factors[:, part].cuda()[:, None]  # [s_i, 1]
        scores = torch.where(part_of == part, part_scores, scores)
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
    probs = (scores * q.shape[-1] ** -0.5).masked_fill(~allowed.cuda(), float("-inf")).softmax(-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, v.repeat_interleave(groups, dim=2).cuda())
    return out, (q, k, v)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("budget", [None, 1000])  # rows per backward call: default, cut
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("hk", [2, 8])  # the two cuts of the inter backward (GQA, MHA)
def test_bf16_fast_path_matches_float64_reference(packed: bool, hk: int, budget: int | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if budget is not None:  # every kind of call cut (L = 896), cuDNN's gradient layouts included
        monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: budget)
    torch.manual_seed(0)
    seq, hq, d, chunk, local = 4096, 8, 128, 1024, 128  # L = 896: 4 chunks + a tail
    cu = torch.tensor([0, 700, 2500, 2600, seq], dtype=torch.int32, device="cuda") if packed \
        else None
    q, k, v = (torch.randn(1, seq, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hk, hk))
    dout = torch.randn(1, seq, hq, d, device="cuda", dtype=torch.bfloat16)
    out = dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local, cu_seqlens=cu)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, leaves = dca_reference_by_part(q, k, v, chunk, local, cu)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    print("relative errors out, dq, dk, dv:", errors)
    assert errors[0] < 1e-2
    assert max(errors[1:]) < 2e-2


def _peak_above_inputs(attention, seq: int, hq: int, hk: int) -> int:
    """Peak bytes allocated during one forward+backward, above q, k, v and dout."""
    q, k, v = (torch.randn(1, seq, h, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hk, hk))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(attention(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_memory_is_linear_in_sequence_length() -> None:
    def dca(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dual_chunk_attention(q, k, v, chunk_size=4096, local_size=512)

    _peak_above_inputs(dca, 4096, 8, 2)  # warm-up: cuDNN workspaces, Triton compilation
    small, large = (_peak_above_inputs(dca, seq, 8, 2) for seq in (16384, 32768))
    print(f"peak above inputs: 16K {small / 2**20:.0f} MiB, 32K {large / 2**20:.0f} MiB")
    assert large < 0.25 * 32768 ** 2 * 4  # well below one fp32 S x S matrix (4 GiB)
    assert large < 2.5 * small  # doubling S roughly doubles memory (quadratic would be 4x)


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)  # [b, s, h, d], as the inputs and dout


@pytest.mark.parametrize(("chunk", "local"), [(8192, 1024), (2048, 256)])
@pytest.mark.parametrize("hk", [16, 4])
def test_peak_memory_within_1p3x_of_cudnn_at_32k(chunk: int, local: int, hk: int) -> None:
    """The memory target on its shapes (B = 1, 16 query heads, d = 128, bf16)."""
    def dca(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local)

    for attention in (_cudnn_causal, dca):  # warm-up on the same shapes: cuDNN graphs, Triton
        _peak_above_inputs(attention, 32768, 16, hk)
    cudnn, ours = (_peak_above_inputs(a, 32768, 16, hk) for a in (_cudnn_causal, dca))
    print(f"32K 16/{hk} C={chunk}: DCA {ours / 2**20:.0f} MiB, cuDNN {cudnn / 2**20:.0f} MiB, "
          f"{ours / cudnn:.2f}x")
    assert ours <= 1.3 * cudnn


@pytest.mark.parametrize("kind", ["log", "yarn"])
def test_bf16_fast_path_with_scaling_matches_float64_reference(kind: str) -> None:
    """Scaled DCA (factors written from the sources' formulas) on the cuDNN/Triton path."""
    torch.manual_seed(1)
    seq, hq, hk, d, chunk, local = 4096, 8, 2, 128, 1024, 128
    if kind == "log":  # Llama 4: 1 + a ln(floor((p + 1) / F) + 1); F small enough to vary here
        scaling = DCAScaling("log", "succ_inter", attn_scale=0.1, floor_scale=512)
        f = [1 + 0.1 * math.log(math.floor((p + 1) / 512) + 1) for p in range(seq)]
        factors = torch.tensor([[1.0, x, x] for x in f], dtype=torch.float64)
    else:  # Qwen2.5-1M: m = max(1, 0.1 ln(n / original) + 1), logits times m^2
        scaling = DCAScaling("yarn", "all")  # original length: the chunk size
        m = max(1.0, 0.1 * math.log(seq / chunk) + 1)
        factors = torch.full((seq, 3), m * m, dtype=torch.float64)
    q, k, v = (torch.randn(1, seq, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hk, hk))
    dout = torch.randn(1, seq, hq, d, device="cuda", dtype=torch.bfloat16)
    out = dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local, scaling=scaling)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, leaves = dca_reference_by_part(q, k, v, chunk, local, part_factors=factors)
    plain, _ = dca_reference_by_part(q, k, v, chunk, local)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    print(f"{kind}: relative errors out, dq, dk, dv:", errors)
    assert rel_err(plain, ref) > 1e-3  # the scaling matters at this size
    assert errors[0] < 1e-2
    assert max(errors[1:]) < 2e-2
