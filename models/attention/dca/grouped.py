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

Where the kernels apply is dispatch.py's decision (`kernel_refusal`): kernel fa4 on a Hopper GPU,
bf16/fp16, no packed documents, L and the sequence multiples of BLOCK (each tile then lies in one
query chunk and one key chunk: only intra's diagonal tiles are partly masked), its head dims.
The forward holds every part's rotated q (three times q's size) for its one call. The backward
holds, per query row and head, its three rotated copies and three float32 dQ accumulators (nine
times q's size in bf16), so under `dca_backward=auto` it runs in as few pieces as keep the
backward's memory within MEMORY_OVER_CAUSAL of causal attention's (`split`): groups of key
heads, each with its query heads, where each group launches at least MIN_GROUP_BLOCKS blocks
(every (head, key block) pair is then still one block of one launch, as in causal attention;
a piece of rows launches a block per key tile up to its end, and a block's fixed work costs ~9
us of an SM); else, on short sequences or with too few heads, pieces of query rows of all
heads. `one_piece` takes everything at once (faster, more memory: docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from models.attention.dca import fa4_backward, fa4_forward
from models.attention.dca.dq_parts import rotate_back
from models.attention.dca.plan import KERNEL_BLOCK as BLOCK
from models.attention.dca.plan import DCAPlan, flat_heads
from models.attention.lse_attention import accumulation_dtype
from models.attention.rope import rotate_transpose_sum

# The backward's memory over causal attention's that dca_backward=auto allows (`split`), and the
# fewest query rows of a row piece: a piece of fewer rows saves under ~0.1 GB (16 heads of 128)
# and costs its own launches (at 8K, C = 2048, where DCA is host-bound, 2.35 ms a call in 2
# pieces, 2.04 in one). Measured: docs/benchmarks.md, "How DCA's backward is cut".
MEMORY_OVER_CAUSAL = 0.15
MIN_PIECE_ROWS = 8192
# The fewest blocks (query heads x batch x key tiles) a group of heads may launch: a launch of
# fewer ends in a tail of its longest blocks (a key tile meets every query tile after it).
# Measured at 16K: 3 heads (384 blocks) 0.77x of FA4 causal against 0.86x for all heads in 2
# pieces of rows; one key head of 16/4 (512 blocks) 0.89x against 0.84x in 4 pieces of rows.
MIN_GROUP_BLOCKS = 512
class Rotated(NamedTuple):
    """What the forward kernel read, kept for the backward under `KernelPaths.keep_rotated`:
    every part's rotated queries [p, b, s, hq, d] (DCAPlan.rotate_parts) and the rotated keys
    [b, s, hk, d]."""
    q: torch.Tensor
    k: torch.Tensor


class Split(NamedTuple):
    """How the backward kernel's work is cut: key heads in even groups of at most
    `kv_per_group` (each group with its query heads), each group's query rows in even pieces of
    at most `rows`."""
    kv_per_group: int
    rows: int

    def head_groups(self, kv_heads: int) -> list[slice]:
        """The key heads of each group, as even as the group size allows."""
        count = -(-kv_heads // self.kv_per_group)
        bounds = [kv_heads * i // count for i in range(count + 1)]
        return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def memory_over_causal(head_share: float, row_pieces: int, heads: int, kv_heads: int) -> float:
    """How much more memory DCA's backward takes than causal attention's, as a fraction of
    causal's, by this model, when a piece holds `head_share` of the heads and 1 / `row_pieces`
    of the rows (per query row, in q rows, r = kv_heads / heads): a piece holds its three
    rotated copies and three float32 dQ accumulators (9 per row and head of the piece); beside
    them DCA holds k rotated (r) and lacks causal attention's float32 dQ accumulator (2); with
    GQA its float32 dK/dV sums hold only the piece's key heads (4r x head_share against
    causal's 4r). Causal attention holds out, dq, dk, dv and that accumulator, with GQA its
    sums too (4 + 2r, + 4r). Checked against the peaks measured at 32K
    (tests/models/test_dca_grouped.py)."""
    ratio = kv_heads / heads
    gqa = kv_heads < heads
    causal = 4 + 2 * ratio + (4 * ratio if gqa else 0)
    sums_left_out = 4 * ratio * (1 - head_share) if gqa else 0
    return (9 * head_share / row_pieces + ratio - 2 - sums_left_out) / causal


def split(batch: int, seq: int, heads: int, kv_heads: int) -> Split:
    """The backward's cut under dca_backward=auto, within MEMORY_OVER_CAUSAL of causal
    attention's memory by `memory_over_causal`: the fewest groups of key heads (6 groups of 16
    heads without GQA, 4 with 16/4 or 32/8) where each group launches at least
    MIN_GROUP_BLOCKS blocks; else (short sequences, or too few heads) all heads at once in the
    fewest pieces of query rows, each at least MIN_PIECE_ROWS."""
    blocks_per_kv_head = batch * -(-seq // BLOCK) * (heads // kv_heads)  # its query heads' blocks
    for groups in range(1, kv_heads + 1):
        size = -(-kv_heads // groups)
        if size * blocks_per_kv_head < MIN_GROUP_BLOCKS:
            break
        if memory_over_causal(size / kv_heads, 1, heads, kv_heads) <= MEMORY_OVER_CAUSAL:
            return Split(size, seq)
    pieces = next(count for count in itertools.count(1) if memory_over_causal(
        1, count, heads, kv_heads) <= MEMORY_OVER_CAUSAL)
    return Split(kv_heads, max(-(-seq // pieces), MIN_PIECE_ROWS))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DCAPlan,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, Rotated | None]:
    """The merged (out [b, s, hq, d] contiguous, lse [b, hq, s]) of all parts, from DCA's
    forward kernel, and what it read rotated where the plan keeps it for the backward (else
    None); q, k, v of any strides with a unit last one (as megatron's views of its fused QKV
    projection), q also [b, s, hk, hq / hk, d] (its heads in groups)."""
    batch, seq, heads, _ = flat_heads(q).shape
    q_rot, k_rot = plan.rotate(q, k)  # [p, b, s, hq, d], [b, s, hk, d]
    out = torch.empty(q_rot.shape[1:], dtype=q.dtype, device=q.device)  # [b, s, hq, d]
    lse = torch.empty(batch, heads, seq, dtype=accumulation_dtype(q), device=q.device)
    fa4_forward.forward(q_rot.flatten(0, 1), k_rot, v, scale, plan.length, plan.successive_rows,
                        out, lse)
    return out, lse, Rotated(q_rot, k_rot) if plan.paths.keep_rotated else None


def backward(plan: DCAPlan, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, cut: Split,
             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             rotated: Rotated | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dual_chunk_attention through DCA's backward kernel, in the pieces `cut`
    says; out and dout contiguous [b, s, h, d], q, k, v of any strides with a unit last one, q
    also [b, s, hk, hq / hk, d] (its heads in groups). `grads`: where to write dq, dk and dv
    (views shaped as q, k and v: models/fused_qkv.py's slots), else new contiguous tensors.
    `rotated`: the forward's rotated q and k (`forward`), read in place of rotating q and k
    again (the cut stays the one for rotating them: its memory is then the accumulators').

    A group of key heads (with its query heads) is a whole backward of its own: its dq, dk and
    dv leave it complete, into views of the heads' slices. Within a group the queries go in even
    pieces of at most `cut.rows` rows (multiples of BLOCK), the last first, each with the keys up
    to its end (the kernel's bottom-right causal alignment): a piece's dq is complete (its
    parts' accumulators rotated back and summed, dq_parts.py); its dk and dv add to the earlier
    pieces' in place (the first, reaching every key, writes them; with GQA all add into float32
    sums converted once at the end), dk in k_rot's frame until one rotation back at the end.
    Only one piece's rotated q and per-part dQ accumulators are alive at a time.
    """
    batch, seq, heads = flat_heads(q).shape[:3]
    heads_kv = k.shape[2]
    group = heads // heads_kv
    count = -(-seq // max(cut.rows, BLOCK))
    size = -(-seq // count // BLOCK) * BLOCK
    k_rot = plan.rotate_k(k) if rotated is None else rotated.k  # [b, s, hk, d]
    dk = torch.empty_like(k_rot)  # in k_rot's frame until the last rotation
    dq, dk_out, dv = grads or (torch.empty_like(q, memory_format=torch.contiguous_format), dk,
                               torch.empty_like(v, memory_format=torch.contiguous_format))
    for kv in cut.head_groups(heads_kv):
        hq = slice(kv.start * group, kv.stop * group)
        q_heads = kv if q.dim() == 5 else hq  # q's (and dq's) index of the group's heads
        # with GQA every piece adds its dK/dV into float32 sums, converted once after the last
        sums = (fa4_backward.kv_accumulators(k_rot[:, :, kv], v[:, :, kv]) if group > 1
                else None)
        for end in range(seq, 0, -size):
            span = slice(max(end - size, 0), end)
            q_rot = (plan.rotate_parts(q[:, :, q_heads], span) if rotated is None
                     else rotated.q[:, :, span, hq])  # [p, b, n, hq', d]
            key_grads = (dk[:, :end, kv], dv[:, :end, kv]) if sums is None else sums
            dq_parts = fa4_backward.backward(
                q_rot.flatten(0, 1), k_rot[:, :end, kv], v[:, :end, kv], out[:, span, hq],
                dout[:, span, hq], lse[:, hq, span], scale, plan.length, plan.successive_rows,
                *key_grads, end < seq)
            del q_rot
            rotate_back(dq_parts, plan.part_positions[:, span], plan.cos, plan.sin,
                        None if plan.q_scale is None else plan.q_scale[:, span], scale,
                        dq[:, span, q_heads])
            del dq_parts  # before the next piece's kernel allocates its own
        if sums is not None:
            fa4_backward.store_kv(sums, dk[:, :, kv], dv[:, :, kv], scale)
            del sums
    for b in range(batch):
        rotate_transpose_sum([dk[b]], [plan.positions[0]], plan.cos, plan.sin, dk_out[b])
    return dq, dk_out, dv
