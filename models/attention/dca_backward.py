"""Dual Chunk Attention's backward: the global-LSE recipe, one part at a time, in place.

Every part's kernel backward gets the merged out and lse (lse_attention.py), so its dq, dk, dv
are exact terms of the full gradient. Memory is what this file is arranged around:
- only one part's rotated q [b, s, hq, d] is alive at a time (k's rotation, the same for every
  part, lives throughout);
- each call's gradients go back through their rotation (a rotation's transpose is the rotation
  with sin negated) and into dq, dk, dv right after the call, then die: intra writes (it reaches
  every row), successive and inter add (`rotate_transpose_sum(..., accumulate=True)`: the sum is
  taken in float32 and rounded once per call, so a bf16 gradient is rounded at most three times);
- the inter staircase, whose calls overlap, sums its overlaps in a float32 buffer first, so a
  document of many chunks does not round once per chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from models.attention.dca_calls import INTER, INTRA, Call, block_lse, blocks, document_calls
from models.attention.lse_attention import attention_backward
from models.attention.rope import rotate_transpose_sum

if TYPE_CHECKING:
    from models.attention.dca import _Plan


class _Document(NamedTuple):
    """One document's tensors: [n, h, d] views (dq, dk, dv written in place), lse [hq, n],
    positions and q_scale [parts, n] (q_scale None: no length scaling)."""
    n: int
    k: torch.Tensor  # rotated to r
    v: torch.Tensor
    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    positions: torch.Tensor
    q_scale: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def dca_backward(plan: _Plan, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dual_chunk_attention; out, dout, v contiguous [b, s, h, d]."""
    k_rot = plan.rotate_k(k)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    docs = []
    for b, start, n in plan.docs:
        rows = slice(start, start + n)
        docs.append(_Document(n, k_rot[b, rows], v[b, rows], out[b, rows], dout[b, rows],
                              lse[b, :, rows], plan.positions[:, rows],
                              None if plan.q_scale is None else plan.q_scale[:, rows],
                              dq[b, rows], dk[b, rows], dv[b, rows]))
    for part in range(plan.num_parts):  # intra first: it writes every row, the others add
        _part_backward(plan, scale, plan.rotate_q(q, part), part, docs)
    return dq, dk, dv


def _part_backward(plan: _Plan, scale: float, q_rot: torch.Tensor, part: int,
                   docs: list[_Document]) -> None:
    """One part's gradients into every document's dq, dk, dv (q_rot [b, s, hq, d] dies with
    this call: nothing here outlives it)."""
    for (b, start, n), doc in zip(plan.docs, docs):
        q_doc = q_rot[b, start:start + n]
        if part == INTER:
            _inter_backward(plan, scale, q_doc, doc)
            continue
        for call in document_calls(n, plan.length)[0]:
            if call.part == part:
                dq_c, dk_c, dv_c = _call_backward(call, q_doc, doc, scale)
                for j, g in _pieces(dq_c, call.q0):
                    _add_dq(plan, doc, part, j, g, accumulate=part != INTRA)
                for (j, gk), (_, gv) in zip(_pieces(dk_c, call.k0), _pieces(dv_c, call.k0)):
                    _add_dkv(plan, doc, j, gk, gv, accumulate=part != INTRA)


def _call_backward(call: Call, q: torch.Tensor, doc: _Document, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's kernel backward: dq [blocks, hq, rows, d], dk and dv [blocks, hk, krows, d]."""
    return attention_backward(
        blocks(doc.dout, call.q0, call.rows, call.blocks),
        blocks(q, call.q0, call.rows, call.blocks),
        blocks(doc.k, call.k0, call.krows, call.blocks),
        blocks(doc.v, call.k0, call.krows, call.blocks),
        blocks(doc.out, call.q0, call.rows, call.blocks),
        block_lse(doc.lse, call.q0, call.rows, call.blocks),
        causal=call.causal, scale=scale)


def _pieces(grad: torch.Tensor, start: int) -> list[tuple[int, torch.Tensor]]:
    """A kernel's [blocks, h, rows, d] gradient as (first row, [rows', h, d]) pieces: one when
    its memory is token-major (cuDNN keeps the inputs' layout), else one per block."""
    grad = grad.transpose(1, 2)  # [blocks, rows, h, d]
    if grad.is_contiguous():
        return [(start, grad.flatten(0, 1))]
    return [(start + j * grad.shape[1], g) for j, g in enumerate(grad)]


def _add_dq(plan: _Plan, doc: _Document, part: int, start: int, grad: torch.Tensor,
            accumulate: bool) -> None:
    """dq[start:] (+)= R^T (f grad) for one part (f: its logit factors; grad scaled in place)."""
    rows = slice(start, start + grad.shape[0])
    if doc.q_scale is not None:
        grad.mul_(doc.q_scale[part, rows, None, None])
    rotate_transpose_sum([grad], [doc.positions[part, rows]], plan.cos, plan.sin, doc.dq[rows],
                         accumulate)


def _add_dkv(plan: _Plan, doc: _Document, start: int, dk: torch.Tensor, dv: torch.Tensor,
             accumulate: bool) -> None:
    """dk[start:] (+)= R(r)^T dk and dv[start:] (+)= dv (keys are rotated alike in every part)."""
    rows = slice(start, start + dk.shape[0])
    rotate_transpose_sum([dk], [doc.positions[INTRA, rows]], plan.cos, plan.sin, doc.dk[rows],
                         accumulate)
    rotate_transpose_sum([dv], None, plan.cos, plan.sin, doc.dv[rows], accumulate)


def _inter_backward(plan: _Plan, scale: float, q: torch.Tensor, doc: _Document) -> None:
    """The inter part's gradients, added into the document's dq, dk, dv.

    The inter region is a staircase: query chunk c sees key chunks 0 .. c-2. Cut into one call
    per query chunk, its dk/dv overlap on key prefixes; cut into one call per key chunk, its dq
    overlaps on query suffixes. Overlaps are summed in float32 (first touch copies, later calls
    add); the cut is the one that accumulates fewer bytes: dq (hq heads) or dk + dv (2 hk).
    """
    length = plan.length
    chunks = -(-doc.n // length)
    if chunks < 3:
        return
    acc_dtype = plan.cos.dtype
    if q.shape[1] >= 2 * doc.k.shape[1]:  # per query chunk
        inter = document_calls(doc.n, length)[1]
        keys = inter[-1].krows  # (chunks - 2) L
        acc_k = torch.empty(keys, *doc.dk.shape[1:], dtype=acc_dtype, device=doc.dk.device)
        acc_v = torch.empty_like(acc_k)
        for call in inter:
            dq_c, dk_c, dv_c = (g[0].transpose(0, 1) for g in _call_backward(call, q, doc, scale))
            _add_dq(plan, doc, INTER, call.q0, dq_c, accumulate=True)
            seen = call.krows - length  # key rows earlier calls already reached
            for acc, g in ((acc_k, dk_c), (acc_v, dv_c)):
                acc[:seen].add_(g[:seen])
                acc[seen:call.krows].copy_(g[seen:])
        _add_dkv(plan, doc, 0, acc_k, acc_v, accumulate=True)
    else:  # per key chunk
        first = 2 * length  # the first inter query row
        acc_q = torch.empty(doc.n - first, *doc.dq.shape[1:], dtype=acc_dtype,
                            device=doc.dq.device)
        for j in range(chunks - 2):
            q0 = (j + 2) * length
            call = Call(INTER, q0, doc.n - q0, 1, j * length, length, False)
            dq_c, dk_c, dv_c = (g[0].transpose(0, 1) for g in _call_backward(call, q, doc, scale))
            if j == 0:
                acc_q.copy_(dq_c)
            else:
                acc_q[q0 - first:].add_(dq_c)
            _add_dkv(plan, doc, j * length, dk_c, dv_c, accumulate=True)
        _add_dq(plan, doc, INTER, first, acc_q, accumulate=True)
