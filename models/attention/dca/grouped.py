"""Dual Chunk Attention through its own kernels, on FlashAttention-4.

The part-call path (attention.py, backward.py) makes a kernel call per part and chunk group
(dozens at 8K with small chunks), each with its own launch, pre/post-processing and merge. DCA's
kernels, both derived from FA4's SM90 causal kernels, do causal attention's loop instead, taking
each (query block, key block) pair's query from its part's rotated copy:

Forward (fa4_forward.py): one call; the query tile is reloaded where its key loop crosses into
the next part, and the online softmax runs on across, so out and lse leave it merged.

Backward (fa4_backward.py): with the merged out and lse (the global-LSE recipe, as in
backward.py); dK/dV leave it summed over the parts, dQ per part in float32 accumulators,
rotated back and summed into dq in one pass (dq_parts.py).

Where the kernels apply (`kernel_applies`): kernel fa4 on CUDA bf16/fp16, no packed documents,
the chunk length L and the sequence multiples of BLOCK (each tile then lies in one query chunk
and one key chunk: only intra's diagonal tiles are partly masked), head dims 64, 96 and 128.
The forward holds every part's rotated q (three times q's size) for its one call. The backward
holds, per query row, its three rotated copies and three float32 dQ accumulators (nine times
the row's size in bf16), so under `dca_backward=auto` it runs in as few pieces of query rows as
keep the backward's memory within MEMORY_OVER_CAUSAL of causal attention's (`pieces`: a fifth
of the rows without GQA, a quarter with it); `one_piece` takes all rows at once (a few percent
faster, ~2.3x the memory; docs/benchmarks.md).
"""

from __future__ import annotations

import itertools

import torch

from models.attention import kernels
from models.attention.dca import fa4_backward, fa4_forward
from models.attention.dca.dq_parts import rotate_back
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.lse_attention import accumulation_dtype
from models.attention.rope import rotate_transpose_sum

BLOCK = 128  # the kernels' query and key tile (FA4's SM90 tiles for head_dim <= 128)
# The backward kernel's pieces under dca_backward=auto: as few as keep the backward's memory
# within MEMORY_OVER_CAUSAL of causal attention's (`pieces`), never fewer than MIN_PIECE_ROWS
# rows each (each piece launches a block per key tile up to its end, and each block's fixed
# work costs ~9 us of an SM: a piece fewer is 0-1.5% faster at 32K, small pieces buy no memory
# worth it). Measured: docs/benchmarks.md, "DCA's passes, its pieces, ..." and "Back to back,
# pieces by memory, ...".
MEMORY_OVER_CAUSAL = 0.15
MIN_PIECE_ROWS = 4096
BACKWARDS = ("auto", "one_piece", "parts")  # the dca_backward setting (`paths`)
# The head dims the kernels were checked at on the H100 (tests/gpu/test_fa4_gpu.py); at 72
# FA4's SM90 backward machinery gave wrong gradients (docs/benchmarks.md). The rest take the
# part calls.
HEAD_DIMS = (64, 96, 128)


def kernel_applies(q: torch.Tensor, length: int, packed: bool) -> bool:
    """Whether DCA's kernels (fa4_forward.py, fa4_backward.py) serve DCA on q with chunk length
    `length` (packed: documents given): kernel fa4 on CUDA bf16/fp16, one document per
    sequence, L and the sequence multiples of BLOCK, head_dim one of HEAD_DIMS. Decided once
    per call, in its DCAPlan."""
    return (kernels.fa4_applies(q) and not packed and length % BLOCK == 0
            and q.shape[1] % BLOCK == 0 and q.shape[3] in HEAD_DIMS)


def paths(q: torch.Tensor, length: int, packed: bool, backward: str) -> KernelPaths:
    """Where DCA runs on q under the `dca_backward` setting: its kernels wherever they apply
    (auto: the backward in pieces, `piece_rows`; one_piece: in one), else, or under parts, the
    part calls."""
    check_backward(backward)
    if backward == "parts" or not kernel_applies(q, length, packed):
        return KernelPaths()
    return KernelPaths(kernels=True, one_piece=backward == "one_piece")


def check_backward(backward: str) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f"dca_backward must be one of {' | '.join(BACKWARDS)}, got {backward!r}")


def memory_over_causal(pieces: int, heads: int, kv_heads: int) -> float:
    """How much more memory DCA's backward in `pieces` pieces of query rows takes than causal
    attention's, as a fraction of causal's, by this model (per query row, in q rows, r =
    kv_heads / heads): a piece holds its rows' three rotated copies and three float32 dQ
    accumulators (9 per row of the piece); beside them DCA holds k rotated (r) and lacks causal
    attention's float32 dQ accumulator (2); causal attention holds out, dq, dk, dv and that
    accumulator, with GQA float32 dK/dV sums too (4 + 2r, + 4r). Checked against the peaks
    measured at 32K (tests/models/test_dca_grouped.py)."""
    ratio = kv_heads / heads
    causal = 4 + 2 * ratio + (4 * ratio if kv_heads < heads else 0)
    return (9 / pieces + ratio - 2) / causal


def pieces(heads: int, kv_heads: int) -> int:
    """The fewest pieces of query rows that keep DCA's backward within MEMORY_OVER_CAUSAL of
    causal attention's memory: 5 with 16/16 heads (1.13x measured), 4 with 16/4 (1.09x)."""
    return next(count for count in itertools.count(1)
                if memory_over_causal(count, heads, kv_heads) <= MEMORY_OVER_CAUSAL)


def piece_rows(seq: int, heads: int, kv_heads: int) -> int:
    """The most query rows of one backward kernel piece under dca_backward=auto."""
    return max(-(-seq // pieces(heads, kv_heads)), MIN_PIECE_ROWS)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DCAPlan,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out [b, s, hq, d] contiguous, lse [b, hq, s]) of all parts, from DCA's
    forward kernel; v contiguous."""
    batch, seq, heads, _ = q.shape
    q_rot, k_rot = plan.rotate(q, k)  # [p, b, s, hq, d], [b, s, hk, d]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads, seq, dtype=accumulation_dtype(q), device=q.device)
    fa4_forward.forward(q_rot.flatten(0, 1), k_rot, v, scale, plan.length, out, lse)
    return out, lse


def backward(plan: DCAPlan, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, rows: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dual_chunk_attention through DCA's backward kernel; out, dout, v
    contiguous [b, s, h, d].

    The queries go in even pieces of at most `rows` rows (multiples of BLOCK), the last first,
    each with the keys up to its end (the kernel's bottom-right causal alignment): a piece's dq
    is complete (its parts' accumulators rotated back and summed, dq_parts.py); its dk and dv
    add to the earlier pieces' in place (the first, reaching every key, writes them; with GQA
    all add into float32 sums converted once at the end), dk in k_rot's frame until one
    rotation back at the end. Only a piece's rotated q and its per-part dQ accumulators are
    alive at a time.
    """
    batch, seq = q.shape[:2]
    count = -(-seq // max(rows, BLOCK))
    size = -(-seq // count // BLOCK) * BLOCK
    k_rot = plan.rotate_k(k)  # [b, s, hk, d]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk, dv = torch.empty_like(k_rot), torch.empty_like(v, memory_format=torch.contiguous_format)
    # with GQA every piece adds its dK/dV into float32 sums, converted once after the last
    sums = fa4_backward.kv_accumulators(k_rot, v) if k.shape[2] < q.shape[2] else None
    for end in range(seq, 0, -size):
        span = slice(max(end - size, 0), end)
        q_rot = plan.rotate_parts(q, span)  # [p, b, n, hq, d]
        key_grads = (dk[:, :end], dv[:, :end]) if sums is None else sums
        dq_parts = fa4_backward.backward(
            q_rot.flatten(0, 1), k_rot[:, :end], v[:, :end], out[:, span], dout[:, span],
            lse[:, :, span], scale, plan.length, *key_grads, end < seq)
        del q_rot
        rotate_back(dq_parts, plan.positions[:, span], plan.cos, plan.sin,
                    None if plan.q_scale is None else plan.q_scale[:, span], scale, dq[:, span])
        del dq_parts  # before the next piece's kernel allocates its own
    if sums is not None:
        fa4_backward.store_kv(sums, dk, dv, scale)
    for b in range(batch):
        rotate_transpose_sum([dk[b]], [plan.positions[0]], plan.cos, plan.sin, dk[b])
    return dq, dk, dv
