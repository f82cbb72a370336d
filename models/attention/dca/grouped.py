"""Dual Chunk Attention in one kernel call each way, on FlashAttention-4.

The part-call path (attention.py, backward.py) makes a kernel call per part and chunk group
(dozens at 8K with small chunks), each with its own launch, pre/post-processing and merge. Here:

Forward: the three rotated query sets (intra, successive, inter) are the batch entries of one
FA4 call over the same rotated keys, and a block-sparse pattern gives each entry its own key
blocks:

    part p, query block m (in chunk c):  intra       key blocks of chunk c before m (full), m
                                                     itself (masked: causal)
                                         successive  the blocks of chunk c - 1 (full)
                                         inter       the blocks of chunks 0 .. c - 2 (full)

so the kernel does causal attention's work and skips the rest. Every listed block lies on or
below the diagonal, so FA4's causal flag masks exactly intra's diagonal blocks (and brings its
longest-first tile order). One merge of the three (out, lse) follows.

Backward: DCA's own kernel (fa4_backward.py: FA4's causal backward taking each query block
from its part's rotated q), with the merged out and lse (the global-LSE recipe, as in
backward.py); dK/dV leave it summed over the parts, dq per part, rotated back and summed once.

Where the kernel applies (`kernel_applies`): kernel fa4 on CUDA bf16/fp16, no packed
documents, the chunk length L and the sequence multiples of BLOCK (each block then lies in one
query chunk and one key chunk: only intra's diagonal blocks are partly masked). Up to
MAX_TOKENS tokens (`applies`) both passes are one call each; they hold every part's rotated q,
out and dq at once (about three times q's size each, dq in float32 too). Above, the forward is
the part calls (bounded memory), and so is the backward under `dca_backward=auto`; under
`kernel` (`paths`) the backward is the kernel over pieces of query rows (the part calls' row
budget): faster, with more transient memory (docs/benchmarks.md). K/V enter the forward as
stride-0 views over the parts (copies for batch > 1).
"""

from __future__ import annotations

import functools

import torch

from models.attention import kernels
from models.attention.dca import fa4_backward
from models.attention.dca.plan import DCAPlan
from models.attention.lse_attention import merge_partials
from models.attention.rope import rotate_transpose_sum

BLOCK = 128  # FA4's SM90 tile (and block-sparse block) for head_dim <= 128
# Up to this many tokens (batch x sequence) DCA takes one call each way; above, the part-call
# forward and the kernel backward in pieces (bounded memory). Measured: docs/benchmarks.md,
# "DCA in one FA4 call each way" and "DCA's own backward kernel".
MAX_TOKENS = 16384
BACKWARDS = ("auto", "kernel", "parts")  # the dca_backward setting (`paths`)


def kernel_applies(q: torch.Tensor, length: int, packed: bool) -> bool:
    """Whether DCA's backward kernel (fa4_backward.py) serves DCA on q with chunk length
    `length` (packed: documents given): kernel fa4 on CUDA bf16/fp16, one document per
    sequence, L and the sequence multiples of BLOCK, head_dim <= 128. Decided once per call,
    in its DCAPlan."""
    head_dim = q.shape[3]
    return (kernels.fa4_applies(q) and not packed and length % BLOCK == 0
            and q.shape[1] % BLOCK == 0 and head_dim <= 128 and head_dim % 8 == 0)


def applies(q: torch.Tensor, length: int, packed: bool) -> bool:
    """Whether both passes run as one call each (see the module docstring): where the kernel
    applies, up to MAX_TOKENS tokens. Decided once per call, in its DCAPlan."""
    return kernel_applies(q, length, packed) and q.shape[0] * q.shape[1] <= MAX_TOKENS


def paths(q: torch.Tensor, length: int, packed: bool, backward: str) -> tuple[bool, bool]:
    """(one_call, kernel_backward) for DCA on q under the `dca_backward` setting: auto (the
    kernel where the one call applies, the bounded part calls above), kernel (the kernel
    wherever it applies, in pieces above MAX_TOKENS) or parts (the part calls)."""
    check_backward(backward)
    if backward == "parts":
        return False, False
    one_call = applies(q, length, packed)
    return one_call, one_call or (backward == "kernel" and kernel_applies(q, length, packed))


def check_backward(backward: str) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f"dca_backward must be one of {' | '.join(BACKWARDS)}, got {backward!r}")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DCAPlan,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out [b, s, hq, d] contiguous, lse [b, hq, s] float32) of all parts."""
    parts, batch = plan.num_parts, q.shape[0]
    q_rot, k_rot = plan.rotate(q, k)  # [p, b, s, hq, d], [b, s, hk, d]
    sparsity = _sparsity(q.shape[1], plan.length, parts, batch, q.device)
    out_p, lse_p = kernels.fa4_module()._flash_attn_fwd(
        q_rot.flatten(0, 1), _over_parts(k_rot, parts), _over_parts(v, parts),
        softmax_scale=scale, causal=True, block_sparse_tensors=sparsity,
        return_lse=True)[:2]
    out_p = out_p.unflatten(0, (parts, batch))  # [p, b, s, hq, d]
    lse_p = lse_p.unflatten(0, (parts, batch))  # [p, b, hq, s]; -inf: a part without keys
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(lse_p.shape[1:], dtype=torch.float32, device=q.device)
    for b in range(batch):
        merge_partials(list(out_p[:, b]), list(lse_p[:, b]), out[b], lse[b])
    return out, lse


def backward(plan: DCAPlan, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, rows: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dual_chunk_attention through DCA's backward kernel; out, dout, v
    contiguous [b, s, h, d].

    The queries go in even pieces of at most `rows` rows (multiples of BLOCK), the last first,
    each with the keys up to its end (the kernel's bottom-right causal alignment): a piece's dq
    is complete, its dk and dv add to the later pieces' (summed in float32, rounded once per
    piece). Only a piece's rotated q and its per-part dq are alive at a time.
    """
    batch, seq = q.shape[:2]
    count = -(-seq // max(rows, BLOCK))
    size = -(-seq // count // BLOCK) * BLOCK
    k_rot = plan.rotate_k(k)  # [b, s, hk, d]
    dq = dk = dv = None
    for end in range(seq, 0, -size):
        span = slice(max(end - size, 0), end)
        q_rot = plan.rotate_parts(q, span)  # [p, b, n, hq, d]
        dq_p, dk_end, dv_end = fa4_backward.backward(
            q_rot.flatten(0, 1), k_rot[:, :end], v[:, :end], out[:, span], dout[:, span],
            lse[:, :, span], scale, plan.length)  # [p * b, n, hq, d], [b, end, hk, d] x 2
        del q_rot
        dq_p = dq_p.unflatten(0, (plan.num_parts, batch))
        if plan.q_scale is not None:  # the kernel saw f * q: its dq is d/d(f q)
            dq_p.mul_(plan.q_scale[:, None, span, None, None])  # [p, 1, n, 1, 1]
        first = dq is None  # the first piece (the last rows) reaches every key: its dk and
        if first:  # dv become the gradients (dk rotated back in place), later pieces add
            dq = torch.empty_like(q, memory_format=torch.contiguous_format)
            dk, dv = dk_end, dv_end
        for b in range(batch):
            rotate_transpose_sum(list(dq_p[:, b]), list(plan.positions[:, span]), plan.cos,
                                 plan.sin, dq[b, span])
            rotate_transpose_sum([dk_end[b]], [plan.positions[0, :end]], plan.cos, plan.sin,
                                 dk[b, :end], accumulate=not first)  # in place when first
            if not first:
                rotate_transpose_sum([dv_end[b]], None, plan.cos, plan.sin, dv[b, :end],
                                     accumulate=True)
        del dq_p, dk_end, dv_end  # before the next piece's kernel allocates its own
    return dq, dk, dv


def _over_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """x [b, ...] as [parts * b, ...]: the same memory for every part (a copy only for b > 1)."""
    return x.unsqueeze(0).expand(parts, *x.shape).flatten(0, 1)


def block_lists(seq: int, length: int,
                parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key blocks each part's query blocks meet, as FA4's forward block-sparse lists (CPU
    int32): (masked count [p, rows], masked index [p, rows, 1], full count [p, rows], full
    index [p, rows, cols]); indices ascend, packed left.
    """
    blocks, per_chunk = seq // BLOCK, length // BLOCK
    chunk = torch.arange(blocks) // per_chunk  # [blocks] chunk of each block
    row, col = torch.arange(blocks)[:, None], torch.arange(blocks)[None, :]
    q_chunk, k_chunk = chunk[row], chunk[col]
    q_block, k_block = row, col
    full = torch.stack([(q_chunk == k_chunk) & (k_block < q_block),  # intra, off the diagonal
                        k_chunk == q_chunk - 1,  # successive
                        k_chunk <= q_chunk - 2])[:parts]  # inter; [p, rows, cols]
    diagonal = (q_block == k_block).expand(blocks, blocks)
    masked = torch.stack([diagonal] + [torch.zeros_like(diagonal)] * (parts - 1))
    full_count = full.sum(-1, dtype=torch.int32)
    # ascending column order, the chosen columns first: sort by (not chosen, column)
    full_index = (~full * blocks + col).argsort(-1).to(torch.int32)
    masked_index = masked.int().argmax(-1, keepdim=True).to(torch.int32)  # the diagonal
    return masked.sum(-1, dtype=torch.int32), masked_index, full_count, full_index


@functools.lru_cache(maxsize=16)
def _sparsity(seq: int, length: int, parts: int, batch: int, device: torch.device):  # noqa: ANN202
    """FA4's forward block-sparse tensors for one shape, on the device (cached per shape)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # with FA4 only

    # [p, ...] -> [p * b, 1 (every head alike), ...], part-major as the call's batch
    lists = [x.repeat_interleave(batch, 0).unsqueeze(1).contiguous().to(device)
             for x in block_lists(seq, length, parts)]
    return BlockSparseTensorsTorch(*lists, block_size=(BLOCK, BLOCK))
