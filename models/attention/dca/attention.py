"""Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling"), exact for training.

With chunk length L = chunk_size - local_size, a token at position p (within its document) has
chunk index n = p div L and in-chunk offset r = p mod L. A query i meets each earlier key j in
exactly one part (keys are always rotated to r_j):

    intra       n_j == n_i (causal)   query rotated to r_i
    successive  n_j == n_i - 1        query rotated to min(r_i + L, C)
    inter       n_j <= n_i - 2        query rotated to min(2L - 1, C)

and one softmax spans all three. An optional length-dependent scaling (scaling.py)
multiplies the logits of the chosen parts by a per-query factor f_i, folded into that part's
rotated query (dq then carries f_i too; dk does by itself: the kernels see the scaled query).
Each part runs as dense attention that also returns its log-sum-exp (the calls: calls.py);
outputs merge by LSE; the backward is the global-LSE recipe (backward.py). Documents of at most
C tokens are plain causal attention at their own positions (one call). Which path a call
takes (plain causal, CUDA graphs, DCA's kernels, the part calls) is dispatch.route's decision
alone. Nothing is S x S on the fused (CUDA fp16/bf16) path and K/V are never repeated. On the
part calls the forward holds one part's rotated q at a time; DCA's own kernels (grouped.py)
take every part's rotated q in their one forward call. The rotations are activations only under
`dca_keep_rotated` (with DCA's kernels); otherwise the backward makes them again (backward.py,
grouped.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from models.attention import kernels
from models.attention.causal import causal_attention
from models.attention.dca import dispatch, grouped
from models.attention.dca.backward import dca_backward
from models.attention.dca.calls import INTER, Call, blocks, document_calls
from models.attention.dca.dispatch import DCAPath
from models.attention.dca.graphs import DCAGraphs, graphs_for
from models.attention.dca.plan import DCAPlan, check_qkv, check_sizes, flat_heads
from models.attention.dca.scaling import DCAScaling
from models.attention.lse_attention import accumulation_dtype, attention_forward, merge_partials
from models.attention.rope import rotate
from models.fused_qkv import gradient_slots
from models.recompute import keep_attention, kept_attention
from models.rope_scaling import RopeScaling


class _DualChunkAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DCAPlan,
                scale: float, graphs: DCAGraphs | None) -> torch.Tensor:
        if not plan.paths.kernels:  # DCA's kernels take any strides with a unit last one
            v = v.contiguous()  # the part calls' chunk views need a dense token axis
        # Inside a recomputed layer (models/recompute.py) the first forward keeps (out, lse)
        # and the recompute reuses them: only the backward's inputs are rebuilt.
        kept = kept_attention(flat_heads(q).shape)  # out's shape
        rotated = None  # the forward kernel's rotated q and k, where the plan keeps them
        if kept is None:
            out, lse, rotated = (
                (*graphs.forward(q, k, v), None) if graphs else _forward(q, k, v, plan, scale))
            keep_attention(out, lse)
        else:  # the recompute: the backward rotates q and k itself
            out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse, *(rotated or ()))
        ctx.plan, ctx.scale, ctx.graphs = plan, scale, graphs
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, *rotated = ctx.saved_tensors
        dout = dout.contiguous()  # out's layout, as the kernel backwards require
        if ctx.graphs is not None:
            return *ctx.graphs.backward(q, k, v, out, lse, dout), None, None, None
        # q in its groups (views of megatron's projection: models/fused_qkv.py): dq, dk and dv
        # into one tensor of the projection's layout, which its split returns as it is
        grads = gradient_slots(q, k, v) if q.dim() == 5 else None
        return (*dca_backward(ctx.plan, ctx.scale, q, k, v, out, lse, dout, grads,
                              grouped.Rotated(*rotated) if rotated else None), None, None, None)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DCAPlan, scale: float,
             ) -> tuple[torch.Tensor, torch.Tensor, grouped.Rotated | None]:
    """The merged (out [b, s, hq, d] contiguous, lse [b, hq, s]) of all parts, and the rotated
    q and k where the plan keeps them for the backward (grouped.forward; else None); v
    contiguous.

    One part at a time, so only its rotated q is alive; intra and successive partials wait for
    their chunk's inter call, and each chunk merges right after it, so partials die early.
    Where DCA's FA4 kernels apply, its forward kernel takes all parts in one call (grouped.py).
    """
    if plan.paths.kernels:
        return grouped.forward(q, k, v, plan, scale)
    batch, seq, heads, _ = q.shape
    k_rot = plan.rotate_k(k)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [b, s, hq, d]
    lse = torch.empty(batch, heads, seq, dtype=accumulation_dtype(q), device=q.device)  # merged
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
    return out, lse, None


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
                         cuda_graphs: bool = False, backward: str = "auto",
                         keep_rotated: bool = False,
                         lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Dual Chunk Attention with exact gradients in q, k, v.

    q: [batch, seq, q_heads, head_dim], or [batch, seq, kv_heads, q_heads / kv_heads, head_dim]
    (megatron's query heads in their groups: models/fused_qkv.py; read in place by DCA's
    kernels, copied for its other paths); k, v: [batch, seq, kv_heads, head_dim], kv_heads
    dividing q_heads (GQA); q and k *before* RoPE (rotate-half over the full head dim, cos and
    sin times `mscale`; frequencies scaled per `rope_scaling`). `softmax_scale` defaults to
    head_dim ** -0.5. `cu_seqlens` (batch 1): cumulative document lengths from 0 to seq;
    positions and chunks restart at every document and no query sees another document.
    `scaling`: optional length-dependent logit scaling (scaling.py; default none).
    `cuda_graphs`: replay the forward and backward as CUDA graphs captured per shape
    (graphs.py; CUDA bf16/fp16 without `cu_seqlens`, else ignored): for launch-bound shapes.
    `backward`: under FA4, auto | one_piece | parts (dispatch.route: DCA's own kernels where they
    apply, the backward in groups of heads or pieces of query rows, bounding its memory
    (grouped.split), or in one piece, ~1% faster at 32K; parts: the part calls both ways).
    `keep_rotated`: where DCA's kernels run (not under CUDA graphs), the forward's rotated
    queries and keys stay activations until the backward, which then need not rotate them
    again (3 copies of q and one of k per call, held from forward to backward).
    `lengths` (inference, without `cu_seqlens`): each batch row's own prompt length, for a
    length-dependent `scaling` (yarn), whose factors follow a document's length: a batch of
    prompts padded to one width then scales each row as that prompt alone (the engine's
    prefill). It may exceed seq (the first piece of a longer prompt).
    Returns [batch, seq, q_heads, head_dim] in q's dtype.
    """
    check_sizes(chunk_size, local_size, rope_theta)
    check_qkv(q, k, v)
    bounds = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    shape = flat_heads(q)  # q's [b, s, hq, d] shape, dtype and device
    scaling = scaling or DCAScaling()
    lengths = _check_lengths(lengths, q, k, v, bounds, scaling)
    longest = q.shape[1] if bounds is None else max(itertools.chain(
        [0], (b - a for a, b in itertools.pairwise(bounds))))
    route = dispatch.route(shape, chunk_size=chunk_size, local_size=local_size, longest=longest,
                           packed=bounds is not None, scaled=scaling.active, backward=backward,
                           keep_rotated=keep_rotated,
                           cuda_graphs=cuda_graphs and lengths is None)
    if q.dim() == 5 and route.path != DCAPath.KERNELS:
        q = q.flatten(2, 3)  # a copy: only DCA's kernels read the query heads in their groups
    plan = DCAPlan(shape, chunk_size, local_size, float(rope_theta), float(mscale), bounds,
                   scaling, rope_scaling, route.paths, lengths)
    if route.path == DCAPath.PLAIN_CAUSAL:  # one causal kernel call, not one per chunk and part
        q, k = (rotate(x, plan.in_document, plan.cos, plan.sin) for x in (q, k))
        return causal_attention(q, k, v, softmax_scale=scale,
                                cu_seqlens=None if bounds is None else torch.tensor(bounds))
    graphs = None
    if route.path == DCAPath.CUDA_GRAPHS:
        key = (q.shape, k.shape, q.dtype, q.device, chunk_size, local_size, float(rope_theta),
               float(mscale), scale, scaling, rope_scaling, kernels.active(),
               plan.paths)
        graphs = graphs_for(key, plan, scale, q, k, v,
                            lambda *args: _forward(*args)[:2], dca_backward)
    return _DualChunkAttention.apply(q, k, v, plan, scale, graphs)


def _check_lengths(lengths: Sequence[int] | None, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, bounds: list[int] | None,
                   scaling: DCAScaling) -> tuple[int, ...] | None:
    """`lengths` as a tuple where a length-dependent scaling reads it (else None: positions
    and the other scalings do not depend on a row's length)."""
    if lengths is None or not scaling.length_dependent:
        return None
    lengths = tuple(int(n) for n in lengths)
    if bounds is not None:
        raise ValueError("lengths with cu_seqlens: packed documents have their own lengths")
    if len(lengths) != q.shape[0] or min(lengths) < 1:
        raise ValueError(f"lengths needs one positive length per batch row ({q.shape[0]}), "
                         f"got {lengths}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("lengths (a length per batch row) is for inference; in training "
                         "give each document its own length through cu_seqlens")
    return lengths


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
