"""Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling"), exact for training.

With chunk length L = chunk_size - local_size, a token at position p (within its document) has
chunk index n = p div L and in-chunk offset r = p mod L. A query i meets each earlier key j in
exactly one part (SPEC.md's table; keys are always rotated to r_j):

    intra       n_j == n_i (causal)   query rotated to r_i
    successive  n_j == n_i - 1        query rotated to min(r_i + L, C)
    inter       n_j <= n_i - 2        query rotated to min(2L - 1, C)

and one softmax spans all three. An optional length-dependent scaling (dca_scaling.py)
multiplies the logits of the chosen parts by a per-query factor f_i, folded into that part's
rotated query (dq then carries f_i too; dk does by itself: the kernels see the scaled query).
Each part runs as dense attention that also returns its log-sum-exp (the calls:
dca_calls.py); outputs merge by LSE; the backward is the global-LSE recipe (dca_backward.py).
Documents of at most C tokens are plain causal attention at their own positions (one call; see
_Plan.causal). Nothing is S x S on the fused (CUDA fp16/bf16) path, K/V are never repeated, and
the forward holds one part's rotated q at a time. Rotations are not saved activations: the
backward makes them again, per kernel call (one fused pass each; dca_backward.py).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from models.attention import kernels
from models.attention.causal import causal_attention
from models.attention.dca_backward import dca_backward
from models.attention.dca_calls import INTER, Call, blocks, document_calls
from models.attention.dca_graphs import DCAGraphs, graphs_for
from models.attention.dca_scaling import DCAScaling, query_factors
from models.attention.lse_attention import attention_forward, merge_partials
from models.attention.rope import rope_cos_sin, rotate, rotate_multi
from models.recompute import keep_attention, kept_attention
from models.rope_scaling import RopeScaling


class _Plan:
    """Everything both passes derive from the arguments: documents, positions, RoPE tables."""

    def __init__(self, q: torch.Tensor, chunk_size: int, local_size: int, theta: float,
                 mscale: float, bounds: list[int] | None, scaling: DCAScaling,
                 rope_scaling: RopeScaling | None = None) -> None:
        batch, seq, _, head_dim = q.shape
        self.length = chunk_size - local_size
        if bounds is None:
            self.docs = [(b, 0, seq) for b in range(batch)]
        else:
            self.docs = [(0, a, e - a) for a, e in itertools.pairwise(bounds) if e > a]
        max_chunks = max(-(-n // self.length) for _, _, n in self.docs)
        self.num_parts = min(3, max_chunks)  # rotations actually needed
        positions = _positions(seq, chunk_size, local_size,
                               None if bounds is None else tuple(bounds), q.device)
        self.positions = positions[:self.num_parts]  # [parts, s]
        self.in_document = positions[3]  # [s]
        table_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Positions reach C itself (min(r + L, C)), so the table has C + 1 rows.
        self.cos, self.sin = _tables(chunk_size + 1, head_dim, theta, mscale, table_dtype,
                                     q.device, rope_scaling)
        # [parts, s] logit factor per rotated query, or None: no scaling (the default)
        self.q_scale = query_factors(scaling, chunk_size, seq,
                                     None if bounds is None else tuple(bounds), self.num_parts,
                                     table_dtype, q.device)
        # Documents of at most C tokens (and 2L: no inter part) are causal attention under RoPE
        # at their own positions: chunk 1's offsets r < w, so its successive query sits at
        # r + L = p, unclamped, and every relative distance is the true one.
        longest = max(n for _, _, n in self.docs)
        self.causal = self.q_scale is None and longest <= min(chunk_size, 2 * self.length)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q rotated for every part [parts, b, s, hq, d]; k rotated to r [b, s, hk, d]."""
        q_rot = rotate_multi(q, self.positions, self.cos, self.sin)
        if self.q_scale is not None:
            q_rot.mul_(self.q_scale[:, None, :, None, None])  # [parts, 1, s, 1, 1]
        return q_rot, self.rotate_k(k)

    def rotate_q(self, q: torch.Tensor, part: int, rows: slice = slice(None)) -> torch.Tensor:
        """q [b, s', hq, d] holding sequence rows `rows` (default all), rotated for one part
        (times that part's logit factors, if any): a contiguous [b, s', hq, d]."""
        q_rot = rotate_multi(q, self.positions[part:part + 1, rows], self.cos, self.sin)[0]
        if self.q_scale is not None:
            q_rot.mul_(self.q_scale[part, rows, None, None])  # [s', 1, 1]
        return q_rot

    def rotate_k(self, k: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """k [b, s', hk, d] holding sequence rows `rows` (default all), rotated to its in-chunk
        offset r (the same for every part): a contiguous [b, s', hk, d]."""
        return rotate_multi(k, self.positions[:1, rows], self.cos, self.sin)[0]


@functools.lru_cache(maxsize=16)
def _positions(seq: int, chunk_size: int, local_size: int, bounds: tuple[int, ...] | None,
               device: torch.device) -> torch.Tensor:
    """[4, seq] int32 query positions of every token for intra, successive and inter, then its
    position in its document (the causal case's).

    Row 0 (r, the in-chunk offset) is also every key's position. Built on the CPU and cached,
    so a layer's call launches nothing for it; positions restart at each document.
    """
    length = chunk_size - local_size
    in_doc = torch.arange(seq)
    if bounds is not None:
        edges = torch.tensor(bounds)
        in_doc = in_doc - edges[:-1].repeat_interleave(edges.diff())
    r = in_doc % length
    succ = torch.clamp(r + length, max=chunk_size)
    inter = torch.full_like(r, min(2 * length - 1, chunk_size))
    return torch.stack([r, succ, inter, in_doc]).to(torch.int32).to(device, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _tables(rows: int, head_dim: int, theta: float, mscale: float, dtype: torch.dtype,
            device: torch.device, scaling: RopeScaling | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width [rows, d/2] cos and sin tables (cached: every layer asks for the same one)."""
    cos, sin = rope_cos_sin(torch.arange(rows, device=device), head_dim, theta, mscale,
                            dtype=dtype, scaling=scaling)
    return cos[:, :head_dim // 2].contiguous(), sin[:, :head_dim // 2].contiguous()


class _DualChunkAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan,
                scale: float, graphs: DCAGraphs | None) -> torch.Tensor:
        v = v.contiguous()  # chunk views need a dense token axis
        # Inside a recomputed layer (models/recompute.py) the first forward keeps (out, lse)
        # and the recompute reuses them: only the backward's inputs are rebuilt.
        kept = kept_attention(q.shape)
        if kept is None:
            out, lse = graphs.forward(q, k, v) if graphs else _forward(q, k, v, plan, scale)
            keep_attention(out, lse)
        else:
            out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.graphs = plan, scale, graphs
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()  # out's layout, as the kernel backwards require
        if ctx.graphs is not None:
            return *ctx.graphs.backward(q, k, v, out, lse, dout), None, None, None
        return *dca_backward(ctx.plan, ctx.scale, q, k, v, out, lse, dout), None, None, None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out [b, s, hq, d] contiguous, lse [b, hq, s]) of all parts; v contiguous.

    One part at a time, so only its rotated q is alive; intra and successive partials wait for
    their chunk's inter call, and each chunk merges right after it, so partials die early.
    """
    batch, seq, heads, _ = q.shape
    k_rot = plan.rotate_k(k)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [b, s, hq, d]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(batch, heads, seq, dtype=lse_dtype, device=q.device)  # merged
    length = plan.length
    calls = [document_calls(n, length) for _, _, n in plan.docs]
    # per document: chunk -> [(out [rows, h, d], lse [h, rows])] of the parts run so far
    partials: list[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in calls]
    for part in range(min(plan.num_parts, INTER)):
        q_rot = plan.rotate_q(q, part)  # [b, s, hq, d]
        for (b, start, n), (batched, _), doc in zip(plan.docs, calls, partials):
            rows = slice(start, start + n)
            for call in batched:
                if call.part == part:
                    _forward_call(call, q_rot[b, rows], k_rot[b, rows], v[b, rows], doc, length,
                                  scale)
        del q_rot
    q_rot = plan.rotate_q(q, INTER) if plan.num_parts > INTER else None
    for (b, start, n), (_, inter), doc in zip(plan.docs, calls, partials):
        rows = slice(start, start + n)
        inter_by_chunk = {call.q0 // length: call for call in inter}
        out_doc, lse_doc = out[b, rows], lse[b, :, rows]
        for chunk in range(-(-n // length)):
            if chunk in inter_by_chunk:
                _forward_call(inter_by_chunk[chunk], q_rot[b, rows], k_rot[b, rows], v[b, rows],
                              doc, length, scale)
            span = slice(chunk * length, min(n, (chunk + 1) * length))
            chunk_parts = doc.pop(chunk)
            merge_partials([o for o, _ in chunk_parts], [lse_p for _, lse_p in chunk_parts],
                           out_doc[span], lse_doc[:, span])
    return out, lse


def _forward_call(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  partials: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], length: int,
                  scale: float) -> None:
    """One call's kernel forward ([n, h, d] document views, q rotated for the call's part);
    its (out [rows, h, d], lse [h, rows]) per chunk into `partials`."""
    o, lse_p = attention_forward(
        blocks(q, call.q0, call.rows, call.blocks), blocks(k, call.k0, call.krows, call.blocks),
        blocks(v, call.k0, call.krows, call.blocks),
        causal=call.causal, scale=scale)  # [blocks, h, rows, d], [blocks, h, rows]
    for j in range(call.blocks):
        chunk = (call.q0 + j * call.rows) // length
        partials.setdefault(chunk, []).append((o[j].transpose(0, 1), lse_p[j]))


def dual_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int,
                         local_size: int, rope_theta: float = 10000.0, mscale: float = 1.0,
                         softmax_scale: float | None = None,
                         cu_seqlens: torch.Tensor | Sequence[int] | None = None,
                         scaling: DCAScaling | None = None,
                         rope_scaling: RopeScaling | None = None,
                         cuda_graphs: bool = False) -> torch.Tensor:
    """Dual Chunk Attention with exact gradients in q, k, v.

    q: [batch, seq, q_heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim], kv_heads
    dividing q_heads (GQA); q and k *before* RoPE (rotate-half over the full head dim, cos and
    sin times `mscale`; frequencies scaled per `rope_scaling`). `softmax_scale` defaults to
    head_dim ** -0.5. `cu_seqlens` (batch 1): cumulative document lengths from 0 to seq;
    positions and chunks restart at every document and no query sees another document.
    `scaling`: optional length-dependent logit scaling (dca_scaling.py; default none).
    `cuda_graphs`: replay the forward and backward as CUDA graphs captured per shape
    (dca_graphs.py; CUDA bf16/fp16 without `cu_seqlens`, else ignored): for launch-bound shapes.
    Returns [batch, seq, q_heads, head_dim] in q's dtype.
    """
    _check_sizes(chunk_size, local_size, rope_theta)
    _check_qkv(q, k, v)
    bounds = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    plan = _Plan(q, chunk_size, local_size, float(rope_theta), float(mscale), bounds,
                 scaling or DCAScaling(), rope_scaling)
    if plan.causal:  # S <= C: one causal kernel call, not one per chunk and part
        q, k = (rotate(x, plan.in_document, plan.cos, plan.sin) for x in (q, k))
        return causal_attention(q, k, v, softmax_scale=scale,
                                cu_seqlens=None if bounds is None else torch.tensor(bounds))
    graphs = None
    if (cuda_graphs and bounds is None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and not torch.cuda.is_current_stream_capturing()):
        key = (q.shape, k.shape, q.dtype, q.device, chunk_size, local_size, float(rope_theta),
               float(mscale), scale, scaling, rope_scaling, kernels.active())
        graphs = graphs_for(key, plan, scale, q, k, v, _forward, dca_backward)
    return _DualChunkAttention.apply(q, k, v, plan, scale, graphs)


def _check_sizes(chunk_size: int, local_size: int, rope_theta: float) -> None:
    for name, value in (("chunk_size", chunk_size), ("local_size", local_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if chunk_size <= local_size:
        raise ValueError(f"chunk_size ({chunk_size}) must exceed local_size ({local_size})")
    if rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq "
                         "and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide query heads ({q.shape[2]})")
    if q.shape[3] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {q.shape[3]}")
    if q.shape[1] == 0:
        raise ValueError("sequence length must be positive")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device")


def _check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], batch: int,
                      seq: int) -> list[int]:
    if batch != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got {batch}")
    bounds = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                               else cu_seqlens)]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq:
        raise ValueError(f"cu_seqlens must run from 0 to seq ({seq}), got {bounds}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds
