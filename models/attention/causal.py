"""Standard causal attention: FlashAttention-4 or torch SDPA (the run's
`trainer.attention_kernel`, kernels.py), GQA without repeated K/V, packed sequences."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.attention import kernels
from models.attention.lse_attention import attention_backward, attention_forward
from models.recompute import keep_attention, keeping, kept_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     softmax_scale: float | None = None,
                     cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention.

    q: [b, s, hq, d]; k, v: [b, s, hk, d] with hk dividing hq. With `cu_seqlens` (batch 1, the
    cumulative document lengths starting at 0) no token attends across a document boundary.
    Returns [b, s, hq, d].
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide query heads ({q.shape[2]})")
    if cu_seqlens is None:
        if keeping():  # a recomputed layer that keeps its attention (models/recompute.py)
            scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
            return _KeptCausalAttention.apply(q, k, v, scale)
        if kernels.fa4_applies(q):
            return kernels.fa4_causal(q, k, v, softmax_scale)
        return _sdpa_causal(q, k, v, softmax_scale)
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got {q.shape[0]}")
    if kernels.fa4_applies(q):  # one varlen call for all documents
        return kernels.fa4_causal(q, k, v, softmax_scale, cu_seqlens)
    bounds = cu_seqlens.tolist()
    # Documents are independent causal problems; one SDPA call each keeps memory O(doc^2) at worst.
    outs = [_sdpa_causal(q[:, a:b], k[:, a:b], v[:, a:b], softmax_scale)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs, dim=1)


# cuDNN first: on the H100 its causal fwd+bwd is the faster one (docs/benchmarks.md, "Attention
# kernels"); SDPA falls through the list for shapes or options (GQA) a backend refuses.
_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_BACKENDS_FOR = {"flash": _BACKENDS[1:], "math": _BACKENDS[3:]}  # others: _BACKENDS


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 softmax_scale: float | None) -> torch.Tensor:
    """SDPA's causal attention under the kernel setting (CPU tensors: SDPA's own choice)."""
    backends = _BACKENDS_FOR.get(kernels.active(), _BACKENDS) if q.is_cuda else _BACKENDS
    with sdpa_kernel(backends, set_priority=True):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, h, s, d]
            is_causal=True, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
        )
    return out.transpose(1, 2)  # [b, s, h, d]


class _KeptCausalAttention(torch.autograd.Function):
    """Causal attention through the LSE-returning kernels (lse_attention.py), so a recomputed
    layer can keep (out, lse) from its first forward and skip the kernel when it recomputes."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d] views
        kept = kept_attention(q.shape)
        if kept is None:
            out, lse = attention_forward(q, k, v, causal=True, scale=scale)
            keep_attention(out, lse)
        else:
            out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out.transpose(1, 2)  # [b, s, h, d]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.transpose(1, 2)
        if dout.stride() != out.stride():  # the kernel backward wants out's layout
            dout = torch.empty_like(out).copy_(dout)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True, scale=ctx.scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None
