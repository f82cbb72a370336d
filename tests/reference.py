"""Independent float64 references for attention tests: dense masked attention and RoPE.

Deliberately naive (materialises the full [S, S] score matrix, repeats K/V for GQA) so that it
shares no code path with the kernels under test.
"""

from __future__ import annotations

import torch


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0,
                mscale: float = 1.0) -> torch.Tensor:
    """Rotate-half RoPE over the full head dim; x: [b, s, h, d], positions: [s] or [b, s]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = positions.to(torch.float64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    angles = pos[..., None] * inv_freq  # [b, s, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # [b, s, 1, d]
    cos, sin = angles.cos() * mscale, angles.sin() * mscale
    x1, x2 = x.double().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x.double() * cos + rotated * sin


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """Softmax attention in float64 with an explicit boolean mask.

    q: [b, s, hq, d]; k, v: [b, s, hk, d] (hk divides hq); allowed: [s, s] or [b, s, s]
    (True where query i may see key j). Returns [b, s, hq, d] in float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    mask = allowed if allowed.dim() == 3 else allowed.unsqueeze(0)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def causal_mask(s: int) -> torch.Tensor:
    """[s, s] lower-triangular boolean mask."""
    return torch.ones(s, s, dtype=torch.bool).tril()


def document_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Document index of every token of a packed sequence given cumulative lengths."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def positions_in_document(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of every token within its own document (restarts at each document)."""
    total = int(cu_seqlens[-1])
    starts = cu_seqlens[:-1][document_ids(cu_seqlens)]
    return torch.arange(total) - starts
