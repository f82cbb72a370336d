"""Dual Chunk Attention through its own kernels, on FlashAttention-4.

The part-call path (attention.py, backward.py) makes a kernel call per part and chunk group
(dozens at 8K with small chunks), each with its own launch, pre/post-processing and merge. DCA's
kernels, both derived from FA4's SM90 causal kernels, do causal attention's loop instead, taking
each (query block, key block) pair's query from its part's rotated copy:

Forward (fa4_forward.py): one call; the query tile is reloaded where its key loop crosses into
the next part, and the online softmax runs on across, so out and lse leave it merged.

Backward (fa4_backward.py): with the merged out and lse (the global-LSE recipe, as in
backward.py); dK/dV leave it summed over the parts, dq per part, rotated back and summed once.

Where the kernels apply (`kernel_applies`): kernel fa4 on CUDA bf16/fp16, no packed documents,
the chunk length L and the sequence multiples of BLOCK (each tile then lies in one query chunk
and one key chunk: only intra's diagonal tiles are partly masked), head dims 64, 96 and 128.
The forward holds every part's rotated q (three times q's size) for its one call. The backward
holds them and the per-part dq (in float32 too), so it runs in one piece up to MAX_TOKENS
tokens and, above, under `dca_backward=kernel`, in pieces of query rows (the part calls' row
budget): faster than the part calls, with more transient memory (docs/benchmarks.md); `auto`
takes the part calls there.
"""

from __future__ import annotations

import torch

from models.attention import kernels
from models.attention.dca import fa4_backward, fa4_forward
from models.attention.dca.dq_parts import rotate_back
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.lse_attention import accumulation_dtype
from models.attention.rope import rotate_transpose_sum

BLOCK = 128  # the kernels' query and key tile (FA4's SM90 tiles for head_dim <= 128)
# Up to this many tokens (batch x sequence) the backward kernel runs in one piece; above, in
# pieces under dca_backward=kernel (else the part calls: bounded memory). Measured:
# docs/benchmarks.md, "DCA in one FA4 call each way" and "DCA's own backward kernel".
MAX_TOKENS = 16384
BACKWARDS = ("auto", "kernel", "parts")  # the dca_backward setting (`paths`)
# The head dims the kernels were checked at on the H100 (tests/gpu/test_fa4_gpu.py). At 72 the
# backward kernel's gradients were wrong (cause not yet found; docs/benchmarks.md); the rest
# take the part calls.
HEAD_DIMS = (64, 96, 128)


def kernel_applies(q: torch.Tensor, length: int, packed: bool) -> bool:
    """Whether DCA's kernels (fa4_forward.py, fa4_backward.py) serve DCA on q with chunk length
    `length` (packed: documents given): kernel fa4 on CUDA bf16/fp16, one document per
    sequence, L and the sequence multiples of BLOCK, head_dim one of HEAD_DIMS. Decided once
    per call, in its DCAPlan."""
    return (kernels.fa4_applies(q) and not packed and length % BLOCK == 0
            and q.shape[1] % BLOCK == 0 and q.shape[3] in HEAD_DIMS)


def paths(q: torch.Tensor, length: int, packed: bool, backward: str) -> KernelPaths:
    """Where DCA's kernels run on q under the `dca_backward` setting: auto (the forward kernel
    wherever it applies, the backward kernel where it takes one piece, up to MAX_TOKENS tokens;
    the bounded part calls above), kernel (both kernels wherever they apply, the backward in
    pieces above MAX_TOKENS) or parts (the part calls both ways)."""
    check_backward(backward)
    if backward == "parts" or not kernel_applies(q, length, packed):
        return KernelPaths()
    one_piece = q.shape[0] * q.shape[1] <= MAX_TOKENS
    return KernelPaths(True, backward == "kernel" or one_piece, one_piece)


def check_backward(backward: str) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f"dca_backward must be one of {' | '.join(BACKWARDS)}, got {backward!r}")


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
    add to the earlier pieces' in place (the first, reaching every key, writes them), dk in
    k_rot's frame until one rotation back at the end. Only a piece's rotated q and its
    per-part dQ accumulators are alive at a time.
    """
    batch, seq = q.shape[:2]
    count = -(-seq // max(rows, BLOCK))
    size = -(-seq // count // BLOCK) * BLOCK
    k_rot = plan.rotate_k(k)  # [b, s, hk, d]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk, dv = torch.empty_like(k_rot), torch.empty_like(v, memory_format=torch.contiguous_format)
    for end in range(seq, 0, -size):
        span = slice(max(end - size, 0), end)
        q_rot = plan.rotate_parts(q, span)  # [p, b, n, hq, d]
        dq_parts = fa4_backward.backward(
            q_rot.flatten(0, 1), k_rot[:, :end], v[:, :end], out[:, span], dout[:, span],
            lse[:, :, span], scale, plan.length, dk[:, :end], dv[:, :end], end < seq)
        del q_rot
        rotate_back(dq_parts, plan.positions[:, span], plan.cos, plan.sin,
                    None if plan.q_scale is None else plan.q_scale[:, span], scale, dq[:, span])
        del dq_parts  # before the next piece's kernel allocates its own
    del k_rot
    for b in range(batch):
        rotate_transpose_sum([dk[b]], [plan.positions[0]], plan.cos, plan.sin, dk[b])
    return dq, dk, dv
