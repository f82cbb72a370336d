"""Standard causal, chunked and Dual Chunk Attention under context parallelism.

Each kind is a `CPPlan` (context_parallel.py): which dense calls a query rank makes against a
KV source rank in the load-balanced layout (rank r holds pieces r and 2N-1-r of P tokens).

  standard  ring; per step one call: the local step is causal over both pieces (they are in
            global order), an earlier source's first piece is seen by both query pieces, a later
            source's two pieces only by the second query piece.
  chunked   a query sees only earlier keys of its own chunk (C tokens). If P is a multiple of C
            every chunk lies inside one piece, so attention is local with no communication at
            all; otherwise direct exchange of just the rows a chunk needs from other ranks.
  DCA       ring. Keys are rotated to their in-chunk offset before they travel (that depends on
            the key alone); each query is rotated three times (intra, successive, inter) from
            its global position. For every (query piece, key piece) pair, queries are cut by
            chunk: intra keys (same chunk; causal within one piece), successive keys (previous
            chunk) and inter keys (earlier chunks) each become a full call of the matching
            rotated query, merged by LSE with all the rest of the row's softmax; the causal
            diagonal and the successive staircase of consecutive chunks inside a piece run as
            one call over blocks each (`join_blocks`). A length-dependent scaling
            (dca/scaling.py) scales each rotated query by its factor, from its global position
            and the global sequence length.

Packed sequences (cu_seqlens) are not supported under CP (core.py raises).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from models.attention.chunked import chunked_attention
from models.attention.context_parallel import CPPlan, PieceLayout, cp_attention
from models.attention.cp_calls import Call, coalesce, join_blocks
from models.attention.dca.calls import INTER, INTRA, SUCCESSIVE
from models.attention.dca.plan import check_qkv, check_sizes
from models.attention.dca.scaling import DCAScaling, query_factors
from models.attention.rope import rope_cos_sin, rotate_multi, rotate_transpose_sum
from models.rope_scaling import RopeScaling


class StandardPlan(CPPlan):
    """Causal attention over the whole sequence (ring)."""

    def calls(self, dst: int, src: int) -> list[Call]:
        p = self.layout.piece_len
        if src == dst:
            return [Call(0, 0, 2 * p, 0, 2 * p, True)]
        if src < dst:  # piece src precedes both query pieces; piece 2N-1-src follows both
            return [Call(0, 0, 2 * p, 0, p, False)]
        # Both pieces of src lie between query pieces dst and 2N-1-dst.
        return [Call(0, p, 2 * p, 0, 2 * p, False)]


@functools.lru_cache(maxsize=256)
def _chunk_calls(layout: PieceLayout, dst: int, src: int, length: int, dca: bool) -> list[Call]:
    """Calls of query rank dst against source rank src for chunks of `length` tokens: the
    intra-chunk part only (chunked attention) or also successive and inter (DCA); chunk after
    chunk diagonals and staircases joined into calls over blocks."""
    return join_blocks(chunk_rectangles(layout, dst, src, length, dca))


def chunk_rectangles(layout: PieceLayout, dst: int, src: int, length: int, dca: bool) -> list[Call]:
    """`_chunk_calls` before joining: one call per query chunk and part (full calls that tile a
    larger rectangle coalesced)."""
    p = layout.piece_len
    calls = []
    for qa, q_off in zip(layout.pieces(dst), (0, p)):
        for kc, k_off in zip(layout.pieces(src), (0, p)):
            if kc > qa:  # every key after every query
                continue
            q_lo, k_lo = qa * p, kc * p  # global first rows of the two pieces
            for n in range(q_lo // length, (q_lo + p - 1) // length + 1):
                a, b = max(q_lo, n * length), min(q_lo + p, (n + 1) * length)  # queries in n
                rows = (q_off + a - q_lo, q_off + b - q_lo)
                if kc == qa:  # the same piece: intra keys are these very rows, causal
                    calls.append(Call(INTRA, *rows, k_off + a - k_lo, k_off + b - k_lo, True))
                else:  # an earlier piece: its keys in chunk n precede every query
                    calls += _full(INTRA, rows, n * length, (n + 1) * length, k_lo, k_off, p)
                if dca:
                    calls += _full(SUCCESSIVE, rows, (n - 1) * length, n * length, k_lo, k_off, p)
                    calls += _full(INTER, rows, 0, (n - 1) * length, k_lo, k_off, p)
    return coalesce(calls)


def _full(part: int, rows: tuple[int, int], lo: int, hi: int, k_lo: int, k_off: int,
          p: int) -> list[Call]:
    """A full call for global keys [lo, hi) clipped to the key piece [k_lo, k_lo + p)."""
    lo, hi = max(lo, k_lo), min(hi, k_lo + p)
    return [Call(part, *rows, k_off + lo - k_lo, k_off + hi - k_lo, False)] if lo < hi else []


class ChunkedPlan(CPPlan):
    """Chunked attention with chunks that straddle pieces (direct exchange)."""

    mode = "direct"

    def __init__(self, layout: PieceLayout, chunk_size: int) -> None:
        super().__init__(layout)
        self.chunk_size = chunk_size

    def calls(self, dst: int, src: int) -> list[Call]:
        return _chunk_calls(self.layout, dst, src, self.chunk_size, False)


class DCARingPlan(CPPlan):
    """Dual Chunk Attention (ring); rotates q and k from global positions."""

    def __init__(self, layout: PieceLayout, chunk_size: int, local_size: int, theta: float,
                 mscale: float, head_dim: int, dtype: torch.dtype, device: torch.device,
                 scaling: DCAScaling, rope_scaling: RopeScaling | None = None) -> None:
        super().__init__(layout)
        self.length = length = chunk_size - local_size
        global_pos = layout.positions()
        r = global_pos % length  # in-chunk offset of every local token
        self.positions = torch.stack([  # [3, 2P] query positions per part; row 0 also keys'
            r, torch.clamp(r + length, max=chunk_size),
            torch.full_like(r, min(2 * length - 1, chunk_size)),
        ]).to(device=device, dtype=torch.int32)
        table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        cos, sin = rope_cos_sin(torch.arange(chunk_size + 1, device=device), head_dim, theta,
                                mscale, dtype=table_dtype, scaling=rope_scaling)  # rows reach C
        half = head_dim // 2  # rotate-half tables: the two halves repeat the same angles
        self.cos, self.sin = cos[:, :half].contiguous(), sin[:, :half].contiguous()
        self.q_scale = query_factors(  # [3, 2P] logit factor per rotated query, or None
            scaling, chunk_size, layout.local_len, None, 3, table_dtype, device,
            offsets=tuple(global_pos.tolist()), total=layout.local_len * layout.size)

    def calls(self, dst: int, src: int) -> list[Call]:
        return _chunk_calls(self.layout, dst, src, self.length, True)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_rot = rotate_multi(q, self.positions, self.cos, self.sin)
        if self.q_scale is not None:
            q_rot.mul_(self.q_scale[:, None, :, None, None])
        return q_rot, rotate_multi(k, self.positions[:1], self.cos, self.sin)[0]

    def add_dq(self, dq: torch.Tensor, part: int, q0: int, grad: torch.Tensor) -> None:
        rows = slice(q0, q0 + grad.shape[0])
        if self.q_scale is not None:  # the rotated queries carried the factors
            grad = grad * self.q_scale[part, rows, None, None]
        rotate_transpose_sum([grad], [self.positions[part, rows]], self.cos, self.sin, dq,
                             accumulate=True)

    def unrotate_k(self, dk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dk_out = torch.empty(dk.shape, dtype=dtype, device=dk.device)
        for b in range(dk.shape[0]):  # [s, h, d] per sequence
            rotate_transpose_sum([dk[b]], [self.positions[0]], self.cos, self.sin, dk_out[b])
        return dk_out


@functools.lru_cache(maxsize=16)
def _dca_plan(layout: PieceLayout, chunk_size: int, local_size: int, theta: float, mscale: float,
              head_dim: int, dtype: torch.dtype, device: torch.device,
              scaling: DCAScaling, rope_scaling: RopeScaling | None = None) -> DCARingPlan:
    """Cached: every layer of a step asks for the same positions and tables."""
    return DCARingPlan(layout, chunk_size, local_size, theta, mscale, head_dim, dtype, device,
                   scaling, rope_scaling)


def _layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            group: dist.ProcessGroup) -> PieceLayout:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "[b, s, hq, d] and [b, s, hk, d] with hk dividing hq")
    return PieceLayout(dist.get_world_size(group), dist.get_rank(group), q.shape[1])


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        group: dist.ProcessGroup, softmax_scale: float | None = None,
                        overlap: bool = True) -> torch.Tensor:
    """Causal attention of this CP rank's tokens; q [b, 2P, hq, d], k, v [b, 2P, hk, d] already
    rotated (megatron's RoPE slices its table for the same layout). Returns [b, 2P, hq, d].
    `overlap=False` waits for each exchange before computing (`parallel.cp_overlap`)."""
    layout = _layout(q, k, v, group)
    return cp_attention(q, k, v, StandardPlan(layout), group, _scale(q, softmax_scale), overlap)


def cp_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int,
                         group: dist.ProcessGroup, softmax_scale: float | None = None,
                         overlap: bool = True) -> torch.Tensor:
    """Chunked causal attention (chunks of `chunk_size` global positions) of this CP rank's
    tokens; shapes as `cp_causal_attention`."""
    layout = _layout(q, k, v, group)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if layout.piece_len % chunk_size == 0:
        # Both pieces start on chunk boundaries and hold whole chunks, so the local sequence is
        # itself chunk-aligned: plain chunked attention on it, no communication.
        return chunked_attention(q, k, v, chunk_size=chunk_size, softmax_scale=softmax_scale)
    return cp_attention(q, k, v, ChunkedPlan(layout, chunk_size), group,
                        _scale(q, softmax_scale), overlap)


def cp_dual_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            chunk_size: int, local_size: int, group: dist.ProcessGroup,
                            rope_theta: float = 10000.0, mscale: float = 1.0,
                            softmax_scale: float | None = None,
                            scaling: DCAScaling | None = None,
                            rope_scaling: RopeScaling | None = None,
                            overlap: bool = True) -> torch.Tensor:
    """Dual Chunk Attention of this CP rank's tokens, q and k *before* RoPE (DCA rotates them
    from each token's global position); otherwise as `dca.dual_chunk_attention`."""
    check_sizes(chunk_size, local_size, rope_theta)
    check_qkv(q, k, v)
    layout = _layout(q, k, v, group)
    plan = _dca_plan(layout, chunk_size, local_size, float(rope_theta), float(mscale),
                     q.shape[-1], q.dtype, q.device, scaling or DCAScaling(), rope_scaling)
    return cp_attention(q, k, v, plan, group, _scale(q, softmax_scale), overlap)
