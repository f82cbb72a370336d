"""The dense kernel calls Dual Chunk Attention makes for one document, and the views they take.

Kernel calls per document of N tokens with chunk length L (nf = N div L full chunks, a tail):
  intra:      one causal call over the full chunks moved into the batch dim, one for the tail;
  successive: one full call over chunk pairs (c, c - 1) batched, one for the tail;
  inter:      one full call per chunk c >= 2 over keys [0, (c - 1) L).
The backward bounds its calls (`bounded`: groups of chunks) and may cut the inter staircase per
key chunk instead (backward.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INTRA, SUCCESSIVE, INTER = 0, 1, 2


class Call(NamedTuple):
    """One dense kernel call within a document (row offsets relative to its start).

    Queries are rows [q0, q0 + blocks * rows) viewed as `blocks` batch entries of `rows`; keys
    likewise from k0 with `krows` per block.
    """
    part: int
    q0: int
    rows: int
    blocks: int
    k0: int
    krows: int
    causal: bool


def document_calls(n_tokens: int, length: int) -> tuple[list[Call], list[Call]]:
    """(intra + successive calls, inter calls in chunk order) for one document."""
    full, tail = divmod(n_tokens, length)
    batched: list[Call] = []
    if full:
        batched.append(Call(INTRA, 0, length, full, 0, length, True))
    if tail:
        batched.append(Call(INTRA, full * length, tail, 1, full * length, tail, True))
    if full >= 2:
        batched.append(Call(SUCCESSIVE, length, length, full - 1, 0, length, False))
    if tail and full >= 1:
        batched.append(Call(SUCCESSIVE, full * length, tail, 1, (full - 1) * length, length,
                            False))
    inter = [Call(INTER, c * length, min(length, n_tokens - c * length), 1, 0, (c - 1) * length,
                  False) for c in range(2, -(-n_tokens // length))]
    return batched, inter


def bounded(calls: list[Call], max_rows: int) -> list[Call]:
    """The calls cut so that none reads more than max(max_rows, its block's rows) query rows:
    a batched call becomes calls over groups of consecutive blocks (its blocks are adjacent
    row ranges of queries and of keys, so each group is a call of the same kind)."""
    cut = []
    for call in calls:
        group = max(1, max_rows // call.rows)
        for first in range(0, call.blocks, group):
            cut.append(call._replace(q0=call.q0 + first * call.rows,
                                     k0=call.k0 + first * call.krows,
                                     blocks=min(group, call.blocks - first)))
    return cut


def blocks(x: torch.Tensor, start: int, rows: int, count: int) -> torch.Tensor:
    """Rows [start, start + count * rows) of a contiguous [s, h, d] as [count, h, rows, d]."""
    return x[start:start + count * rows].view(count, rows, *x.shape[1:]).transpose(1, 2)


def block_lse(lse: torch.Tensor, start: int, rows: int, count: int) -> torch.Tensor:
    """Rows of a merged [h, s] lse as the contiguous [count, h, rows] a kernel backward wants."""
    part = lse[:, start:start + count * rows]
    return part.unflatten(1, (count, rows)).transpose(0, 1).contiguous()
