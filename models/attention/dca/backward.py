"""Dual Chunk Attention's backward: the global-LSE recipe in bounded kernel calls, in place.

Every call's kernel backward gets the merged out and lse (lse_attention.py), so its dq, dk, dv
are exact terms of the full gradient. Memory is what this file is arranged around: cuDNN's
causal backward holds about six copies of q (out, dq, dk, dv and its float32 dq accumulator),
and everything here beyond the mandatory out, dq, dk, dv is kept to a fraction of that:
- a kernel call reads at most `rows_per_call` query rows (a sixth of the tokens, at least
  MIN_ROWS_PER_CALL): batched chunk calls are cut into groups of chunks, the inter staircase's
  query range into pieces, so a kernel's own gradients and workspace stay a fraction of q's;
- each call rotates just the q and k rows it reads (one memory-bound pass each), so no rotated
  copy of all of q or k is alive;
- each call's gradients go back through their rotation (a rotation's transpose is the rotation
  with sin negated) and into dq, dk, dv right after the call: intra writes (its calls reach
  every row once), successive and inter add (`rotate_transpose_sum(..., accumulate=True)`: the
  sum is taken in float32 and rounded once per add);
- the inter staircase, whose calls overlap, sums the overlaps that grow with the chunk count in
  float32 first (dq for MHA, dk/dv for GQA), so a document of many chunks does not round once
  per chunk. A bf16 dq is rounded at most three times; dk and dv three times, or at most six
  for MHA keys whose inter query range is cut into pieces (up to BF16_PIECES pieces add one by
  one; more sum in float32 buffers of one chunk's rows first).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.attention.dca import grouped
from models.attention.dca.calls import (
    INTER,
    INTRA,
    Call,
    block_lse,
    blocks,
    bounded,
    document_calls,
)
from models.attention.dca.plan import DCAPlan, flat_heads
from models.attention.lse_attention import attention_backward
from models.attention.rope import rotate_transpose_sum

# A call's query rows: at most a sixth of the tokens, but never fewer than this many (below
# it the calls get too small to fill the GPU, and at 8K the budget is one call per part).
MIN_ROWS_PER_CALL = 8192
# An MHA key chunk whose inter query range is cut into more pieces than this sums its dk/dv in
# float32 first (one chunk's rows), so they are not rounded once per piece.
BF16_PIECES = 4


class _Document(NamedTuple):
    """One document (its first row `start` in the sequence, `n` tokens): [n, h, d] views (dq, dk,
    dv written in place), lse [hq, n], positions and q_scale [parts, n] (q_scale None: no
    length scaling)."""
    start: int
    n: int
    q: torch.Tensor  # unrotated
    k: torch.Tensor  # unrotated
    v: torch.Tensor
    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    positions: torch.Tensor
    q_scale: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def rows_per_call(tokens: int) -> int:
    """The most query rows one kernel call of the backward reads, for `tokens` in the batch."""
    return max(tokens // 6, MIN_ROWS_PER_CALL)


def dca_backward(plan: DCAPlan, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 rotated: grouped.Rotated | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dual_chunk_attention; out and dout contiguous [b, s, h, d], v too
    unless the plan chose DCA's own kernels (dispatch.route): then its backward kernel in one
    piece, or in the pieces of grouped.split (grouped.backward), dq, dk and dv written into
    `grads` where given (only there: q in its groups, models/fused_qkv.py), q and k read
    rotated from `rotated` where the forward kept them."""
    if plan.paths.kernels:
        batch, seq, heads, heads_kv = *flat_heads(q).shape[:3], k.shape[2]
        cut = (grouped.Split(heads_kv, seq) if plan.paths.one_piece
               else grouped.split(batch, seq, heads, heads_kv))
        return grouped.backward(plan, scale, q, k, v, out, lse, dout, cut, grads, rotated)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    budget = rows_per_call(q.shape[0] * q.shape[1])
    for b, start, n in plan.docs:
        rows = slice(start, start + n)
        doc = _Document(start, n, q[b, rows], k[b, rows], v[b, rows], out[b, rows], dout[b, rows],
                        lse[b, :, rows], plan.positions[:, rows],
                        None if plan.q_scale is None else plan.q_scale[:, rows],
                        dq[b, rows], dk[b, rows], dv[b, rows])
        for call in bounded(document_calls(n, plan.length)[0], budget):  # intra calls first
            _batched_call_backward(plan, scale, call, doc)
        if -(-n // plan.length) >= 3:
            if q.shape[2] >= 2 * k.shape[2]:
                _inter_by_query_chunk(plan, scale, doc)
            else:
                _inter_by_key_chunk(plan, scale, doc, budget)
    return dq, dk, dv


def _rotated_q(plan: DCAPlan, doc: _Document, part: int, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of the document's q rotated for `part`: [count, hq, d]."""
    rows = slice(doc.start + start, doc.start + start + count)  # in the sequence
    return plan.rotate_q(doc.q[None, start:start + count], part, rows)[0]


def _rotated_k(plan: DCAPlan, doc: _Document, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of the document's k rotated as keys: [count, hk, d]."""
    rows = slice(doc.start + start, doc.start + start + count)
    return plan.rotate_k(doc.k[None, start:start + count], rows)[0]


def _kernel_backward(call: Call, q_rot: torch.Tensor, k_rot: torch.Tensor, doc: _Document,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's kernel backward (q_rot from row call.q0, k_rot from call.k0): dq [blocks, hq,
    rows, d], dk and dv [blocks, hk, krows, d]."""
    return attention_backward(
        blocks(doc.dout, call.q0, call.rows, call.blocks),
        blocks(q_rot, 0, call.rows, call.blocks),
        blocks(k_rot, 0, call.krows, call.blocks),
        blocks(doc.v, call.k0, call.krows, call.blocks),
        blocks(doc.out, call.q0, call.rows, call.blocks),
        block_lse(doc.lse, call.q0, call.rows, call.blocks),
        causal=call.causal, scale=scale)


def _batched_call_backward(plan: DCAPlan, scale: float, call: Call, doc: _Document) -> None:
    """An intra (writes) or successive (adds) call's gradients into dq, dk, dv."""
    q_rot = _rotated_q(plan, doc, call.part, call.q0, call.rows * call.blocks)
    k_rot = _rotated_k(plan, doc, call.k0, call.krows * call.blocks)
    dq_c, dk_c, dv_c = _kernel_backward(call, q_rot, k_rot, doc, scale)
    del q_rot, k_rot
    accumulate = call.part != INTRA
    for j, g in _pieces(dq_c, call.q0):
        _add_dq(plan, doc, call.part, j, g, accumulate)
    for (j, gk), (_, gv) in zip(_pieces(dk_c, call.k0), _pieces(dv_c, call.k0)):
        _add_dkv(plan, doc, j, gk, gv, accumulate)


def _pieces(grad: torch.Tensor, start: int) -> list[tuple[int, torch.Tensor]]:
    """A kernel's [blocks, h, rows, d] gradient as (first row, [rows', h, d]) pieces: one when
    its memory is token-major (cuDNN keeps the inputs' layout), else one per block."""
    grad = grad.transpose(1, 2)  # [blocks, rows, h, d]
    if grad.is_contiguous():
        return [(start, grad.flatten(0, 1))]
    return [(start + j * grad.shape[1], g) for j, g in enumerate(grad)]


def _add_dq(plan: DCAPlan, doc: _Document, part: int, start: int, grad: torch.Tensor,
            accumulate: bool) -> None:
    """dq[start:] (+)= R^T (f grad) for one part (f: its logit factors; grad scaled in place)."""
    rows = slice(start, start + grad.shape[0])
    if doc.q_scale is not None:
        grad.mul_(doc.q_scale[part, rows, None, None])
    rotate_transpose_sum([grad], [doc.positions[part, rows]], plan.cos, plan.sin, doc.dq[rows],
                         accumulate)


def _add_dkv(plan: DCAPlan, doc: _Document, start: int, dk: torch.Tensor, dv: torch.Tensor,
             accumulate: bool) -> None:
    """dk[start:] (+)= R(r)^T dk and dv[start:] (+)= dv (keys are rotated alike in every part)."""
    rows = slice(start, start + dk.shape[0])
    rotate_transpose_sum([dk], [doc.positions[INTRA, rows]], plan.cos, plan.sin, doc.dk[rows],
                         accumulate)
    rotate_transpose_sum([dv], None, plan.cos, plan.sin, doc.dv[rows], accumulate)


def _inter_by_query_chunk(plan: DCAPlan, scale: float, doc: _Document) -> None:
    """The inter staircase (query chunk c sees key chunks 0 .. c-2) cut into one call per query
    chunk: each call's dq is complete, its dk/dv overlap on key prefixes and sum in float32
    buffers first. The cut for GQA, whose k/v are the smaller side."""
    length = plan.length
    inter = document_calls(doc.n, length)[1]
    keys = inter[-1].krows  # (chunks - 2) L
    k_rot = _rotated_k(plan, doc, 0, keys)
    acc_k = torch.empty(keys, *doc.dk.shape[1:], dtype=plan.cos.dtype, device=doc.dk.device)
    acc_v = torch.empty_like(acc_k)
    for call in inter:
        q_rot = _rotated_q(plan, doc, INTER, call.q0, call.rows)
        dq_c, dk_c, dv_c = (g[0].transpose(0, 1)
                            for g in _kernel_backward(call, q_rot, k_rot, doc, scale))
        del q_rot
        _add_dq(plan, doc, INTER, call.q0, dq_c, accumulate=True)
        seen = call.krows - length  # key rows earlier calls already reached
        for acc, g in ((acc_k, dk_c), (acc_v, dv_c)):
            acc[:seen].add_(g[:seen])
            acc[seen:call.krows].copy_(g[seen:])
    _add_dkv(plan, doc, 0, acc_k, acc_v, accumulate=True)


def _inter_by_key_chunk(plan: DCAPlan, scale: float, doc: _Document, budget: int) -> None:
    """The inter staircase cut per key chunk j (queries from chunk j + 2 on), each query range
    cut again into pieces of at most `budget` rows. dq overlaps across key chunks and sums in
    a float32 buffer (rounded once); a key chunk's dk/dv are added once per piece, or, past
    BF16_PIECES pieces, summed in float32 buffers of one chunk's rows and added once. Every
    buffer but dq's stays smaller than a kernel call's. The cut for MHA, whose q is no bigger
    than k and v."""
    length = plan.length
    first = 2 * length  # the first inter query row
    acc_q = torch.empty(doc.n - first, *doc.dq.shape[1:], dtype=plan.cos.dtype,
                        device=doc.dq.device)
    for j in range(-(-doc.n // length) - 2):
        k_rot = _rotated_k(plan, doc, j * length, length)
        pieces = _pieces_of((j + 2) * length, doc.n, budget)
        acc_k = acc_v = None
        for i, (q0, rows) in enumerate(pieces):
            call = Call(INTER, q0, rows, 1, j * length, length, False)
            q_rot = _rotated_q(plan, doc, INTER, q0, rows)
            dq_c, dk_c, dv_c = (g[0].transpose(0, 1)
                                for g in _kernel_backward(call, q_rot, k_rot, doc, scale))
            del q_rot
            acc_rows = acc_q[q0 - first:q0 - first + rows]
            if j == 0:  # key chunk 0 reaches every inter query row
                acc_rows.copy_(dq_c)
            else:
                acc_rows.add_(dq_c)
            if len(pieces) <= BF16_PIECES:
                _add_dkv(plan, doc, j * length, dk_c, dv_c, accumulate=True)
            elif i == 0:
                acc_k, acc_v = dk_c.to(plan.cos.dtype), dv_c.to(plan.cos.dtype)
            else:
                acc_k.add_(dk_c)
                acc_v.add_(dv_c)
        if acc_k is not None:
            _add_dkv(plan, doc, j * length, acc_k, acc_v, accumulate=True)
    _add_dq(plan, doc, INTER, first, acc_q, accumulate=True)


def _pieces_of(start: int, end: int, budget: int) -> list[tuple[int, int]]:
    """Rows [start, end) as the fewest (first row, rows) pieces of at most `budget` rows, as
    even as possible."""
    count = -(-(end - start) // budget)
    size, extra = divmod(end - start, count)
    pieces = []
    for i in range(count):
        rows = size + (i < extra)
        pieces.append((start, rows))
        start += rows
    return pieces
