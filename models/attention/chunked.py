"""Chunked causal attention (Llama 4 style).

A query at position i sees key j iff j <= i and j // C == i // C, positions counted from the start
of the query's document. Compute and memory are O(S * C) instead of O(S^2).

Implementation: every chunk is an independent causal attention problem, so the chunks are folded
into the batch dimension of a single causal ``scaled_dot_product_attention`` call (no mask tensor,
so the fused flash / memory-efficient kernels stay eligible). Chunks shorter than C (the tail of a
sequence, short documents) go into one extra causal call per distinct length instead of being
padded to C. Under FlashAttention-4 (`trainer.attention_kernel`, kernels.py) the chunks of a
batch-1 sequence, packed or not, are the sequences of one varlen call instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models.attention import kernels

__all__ = ["chunked_attention"]


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int,
                      softmax_scale: float | None = None,
                      cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Causal attention restricted to contiguous chunks of ``chunk_size`` tokens.

    Args:
        q: [b, s, hq, d] queries, already rotated.
        k: [b, s, hk, d] keys, already rotated; hk must divide hq (GQA, K/V are never repeated).
        v: [b, s, hk, dv] values.
        chunk_size: C, tokens per chunk (positive int).
        softmax_scale: score scale; defaults to d ** -0.5.
        cu_seqlens: optional packed-sequence boundaries (batch must be 1): cumulative document
            lengths starting at 0 and ending at s. Chunks restart at each document start and no
            query sees another document.

    Returns:
        [b, s, hq, dv] attention output in q's dtype.
    """
    _validate(q, k, v, chunk_size)
    if kernels.fa4_applies(q) and q.shape[0] == 1:
        bounds = ([0, q.shape[1]] if cu_seqlens is None
                  else _validate_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1]))
        return kernels.fa4_causal(q, k, v, softmax_scale, _chunk_bounds(bounds, chunk_size))
    if cu_seqlens is None:
        return _chunked_contiguous(q, k, v, chunk_size, softmax_scale)
    bounds = _validate_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    return _chunked_packed(q, k, v, chunk_size, softmax_scale, bounds)


def _chunk_bounds(bounds: list[int], chunk_size: int) -> torch.Tensor:
    """Cumulative lengths of the chunks of documents with cumulative lengths `bounds`."""
    edges = [start for a, b in zip(bounds[:-1], bounds[1:]) for start in range(a, b, chunk_size)]
    return torch.tensor(edges + [bounds[-1]], dtype=torch.int32)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            softmax_scale: float | None) -> torch.Tensor:
    """Plain causal attention on [B, L, h, d] tensors (each batch entry is one chunk)."""
    if kernels.fa4_applies(q):
        return kernels.fa4_causal(q, k, v, softmax_scale)
    # enable_gqa only when needed: some fused backends reject the flag even with equal heads.
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(  # [B, hq, L, dv]
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, scale=softmax_scale, enable_gqa=gqa)
    return out.transpose(1, 2)  # [B, L, hq, dv]


def _chunked_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                        softmax_scale: float | None) -> torch.Tensor:
    """Chunked attention without packing: n = s // C full chunks plus one tail of s % C tokens."""
    b, s = q.shape[:2]
    n = s // chunk_size
    full = n * chunk_size
    outs = []
    if n:
        def fold(x: torch.Tensor) -> torch.Tensor:
            # Split the sequence axis into (n, C) BEFORE merging with batch so that each new batch
            # entry holds C contiguous tokens (the strided-grouping trap of the SPEC). Only copies
            # when b > 1 and there is a tail, since then the slice is not mergeable in place.
            return x[:, :full].reshape(b * n, chunk_size, *x.shape[2:])  # [b*n, C, h, d]
        out = _causal(fold(q), fold(k), fold(v), softmax_scale)  # [b*n, C, hq, dv]
        outs.append(out.reshape(b, full, *out.shape[2:]))  # [b, n*C, hq, dv]
    if full < s:
        outs.append(_causal(q[:, full:], k[:, full:], v[:, full:], softmax_scale))  # [b, s%C, ...]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [b, s, hq, dv]


def _chunked_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                    softmax_scale: float | None, bounds: list[int]) -> torch.Tensor:
    """Chunked attention over packed documents (batch 1).

    Every document is cut into chunks from its own start. Chunks are grouped by length: all
    full-length chunks of all documents form one batched call, and the ragged pieces (document
    tails, short documents) one call per distinct length. Outputs are scattered back by token index.
    """
    starts_by_len: dict[int, list[int]] = {}
    for doc_start, doc_end in zip(bounds[:-1], bounds[1:]):
        for start in range(doc_start, doc_end, chunk_size):
            length = min(chunk_size, doc_end - start)
            starts_by_len.setdefault(length, []).append(start)

    q0, k0, v0 = q[0], k[0], v[0]  # [s, h, d]
    token_index, pieces = [], []
    for length, starts in starts_by_len.items():
        idx = (torch.tensor(starts, device=q.device)[:, None]
               + torch.arange(length, device=q.device))  # [m, L] token positions
        flat = idx.reshape(-1)
        group = [x.index_select(0, flat).view(len(starts), length, *x.shape[1:])
                 for x in (q0, k0, v0)]  # each [m, L, h, d]
        pieces.append(_causal(*group, softmax_scale).flatten(0, 1))  # [m*L, hq, dv]
        token_index.append(flat)

    # Every token belongs to exactly one chunk, so this scatter is a permutation (differentiable).
    gathered = torch.cat(pieces)  # [s, hq, dv], in chunk-group order
    out = gathered.new_empty(gathered.shape).index_copy(0, torch.cat(token_index), gathered)
    return out.unsqueeze(0)  # [1, s, hq, dv]


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunked attention: chunk_size must be a positive int, got "
                         f"{chunk_size!r}; set attention.chunk_size to e.g. 8192.")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] == 0:
        raise ValueError(f"chunked attention: q, k, v must be [batch, seq, heads, dim] with seq "
                         f"> 0, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"chunked attention: q, k, v must share batch and seq (and k, v heads), "
                         f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"chunked attention: q and k head dims differ ({q.shape[3]} vs "
                         f"{k.shape[3]}); use the same kv_channels for queries and keys.")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"chunked attention: {q.shape[2]} query heads are not divisible by "
                         f"{k.shape[2]} key/value heads; choose num_query_groups dividing "
                         f"num_attention_heads.")


def _validate_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], batch: int,
                         seq: int) -> list[int]:
    """Check packing boundaries and return them as host ints (one sync, needed for the shapes)."""
    bounds = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                               else cu_seqlens)]
    if batch != 1:
        raise ValueError(f"chunked attention: cu_seqlens (packed sequences) requires batch 1, got "
                         f"batch {batch}; pack the micro-batch into one sequence.")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq:
        raise ValueError(f"chunked attention: cu_seqlens must start at 0 and end at seq={seq}, "
                         f"got {bounds[:3]}...{bounds[-1:]}; pass cumulative document lengths "
                         f"covering the whole packed sequence.")
    if any(a > b for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"chunked attention: cu_seqlens must be non-decreasing, got {bounds}; "
                         f"pass cumulative document lengths.")
    return bounds
