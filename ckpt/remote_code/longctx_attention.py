"""longctx's attention variants over a KV cache, in plain torch (shipped inside model exports).

Layout [batch, heads, seq, head_dim]. The queries are the last `sq` of the `sk` cached positions
(a prefill has sq == sk, a decoding step sq == 1), so one function serves both. Queries are
processed in blocks of at most MAX_ROWS rows that never straddle a chunk, which bounds the score
matrices at [MAX_ROWS, sk]; K/V heads are never repeated (GQA folds the query heads instead).

Dual Chunk Attention (An et al. 2024) with chunk length L = chunk_size - local_size: a key at
position j is rotated to r_j = j mod L (so the cache holds keys rotated once); a query at position
i in chunk n = i div L meets keys of its own chunk rotated to r_i, the previous chunk's rotated to
min(r_i + L, chunk_size), and older ones rotated to min(2L - 1, chunk_size), all in one softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 1024


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, h, s, d] rotated by cos, sin [s, d] (rotate-half), computed in float32 or wider."""
    wide = torch.promote_types(x.dtype, cos.dtype)
    xw = x.to(wide)
    x1, x2 = xw.chunk(2, dim=-1)
    return (xw * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def dca_positions(pos: torch.Tensor, chunk_size: int,
                  local_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE positions of tokens at `pos` as (keys and intra-chunk queries, successive-chunk
    queries, inter-chunk queries)."""
    length = chunk_size - local_size
    r = pos % length
    return r, torch.clamp(r + length, max=chunk_size), torch.full_like(r, min(2 * length - 1,
                                                                             chunk_size))


def _blocks(start: int, rows: int, period: int | None) -> list[tuple[int, int]]:
    """[s0, s1) row ranges of the queries at positions start..start+rows-1, each inside one
    `period`-aligned chunk (any, without a period) and at most MAX_ROWS long."""
    out, s0 = [], 0
    while s0 < rows:
        s1 = min(rows, s0 + MAX_ROWS)
        if period:
            s1 = min(s1, ((start + s0) // period + 1) * period - start)
        out.append((s0, s1))
        s0 = s1
    return out


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, hq, r, d] -> [b, hk, hq / hk, r, d]: each K/V head's query heads together."""
    return q.unflatten(1, (kv_heads, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     chunk_size: int | None = None) -> torch.Tensor:
    """Causal attention of q [b, hq, sq, d] (the last sq positions) over k, v [b, hk, sk, d];
    with `chunk_size`, a query sees only the keys of its own chunk (Llama 4's chunked layers).
    Returns [b, hq, sq, d]."""
    sq, sk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if chunk_size is None and sq == sk:  # a whole-sequence prefill: one fused causal call
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    start = sk - sq
    out = torch.empty_like(q)
    for s0, s1 in _blocks(start, sq, chunk_size):
        k0 = (start + s0) // chunk_size * chunk_size if chunk_size else 0
        k1 = start + s1
        # key j (absolute k0 + column) is visible to query i (absolute start + row) iff j <= i
        mask = (torch.arange(k0, k1, device=q.device)[None, :]
                <= torch.arange(start + s0, start + s1, device=q.device)[:, None])  # [rows, keys]
        out[:, :, s0:s1] = F.scaled_dot_product_attention(
            q[:, :, s0:s1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=mask, scale=scale,
            enable_gqa=gqa)
    return out


def dca_attention(q: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, *, chunk_size: int,
                  local_size: int, cos: torch.Tensor, sin: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Dual Chunk Attention of q [b, hq, sq, d] (unrotated; the last sq positions) over
    k_rot [b, hk, sk, d] (each key rotated to r_j) and v; cos, sin [chunk_size + 1, d] are the
    RoPE tables of positions 0..chunk_size (any attention factor included).
    Returns [b, hq, sq, d]."""
    length = chunk_size - local_size
    sq, sk, kv_heads = q.shape[2], k_rot.shape[2], k_rot.shape[1]
    start = sk - sq
    out = torch.empty_like(q)
    for s0, s1 in _blocks(start, sq, length):
        pos = torch.arange(start + s0, start + s1, device=q.device)
        c0 = (start + s0) // length * length  # first position of the queries' chunk
        intra, succ, inter = dca_positions(pos, chunk_size, local_size)
        spans = [(intra, c0, start + s1), (succ, max(c0 - length, 0), c0),
                 (inter, 0, max(c0 - length, 0))]
        scores, values = [], []
        for qpos, k0, k1 in spans:
            if k1 <= k0:
                continue
            q_rot = _grouped(rotate(q[:, :, s0:s1], cos[qpos], sin[qpos]), kv_heads)
            scores.append(torch.einsum("bhgrd,bhkd->bhgrk", q_rot, k_rot[:, :, k0:k1]).float()
                          * scale)  # [b, hk, g, rows, keys]
            values.append(v[:, :, k0:k1])
        causal = torch.arange(c0, start + s1, device=q.device)[None, :] <= pos[:, None]
        scores[0] = scores[0].masked_fill(~causal, float("-inf"))
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(v.dtype)
        widths = [s.shape[-1] for s in scores]
        block = sum(torch.einsum("bhgrk,bhkd->bhgrd", p, val)
                    for p, val in zip(probs.split(widths, dim=-1), values))
        out[:, :, s0:s1] = block.flatten(1, 2)
    return out
