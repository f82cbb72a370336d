"""Dense attention that returns its log-sum-exp, a backward that takes any (out, lse), and the
LSE merge of partial results.

These are the pieces of the ring-attention / global-LSE recipe: split the keys of one softmax
into parts, run each part with a dense kernel that returns (out_p, lse_p), merge

    lse = log(sum_p exp(lse_p)),   out = sum_p exp(lse_p - lse) * out_p,

and in backward call every part's kernel backward with the *merged* out and lse. The kernel
backward recomputes P = exp(S * scale - lse), which with the merged lse is the global softmax's
probability, and delta = rowsum(dO * out) with the merged out is the global delta, so the
per-part dq, dk, dv are exact and simply add up.

Backends: on CUDA with fp16/bf16, the kernel `trainer.attention_kernel` chose (kernels.py):
FlashAttention-4 (`_flash_attn_fwd` with its LSE, `_flash_attn_bwd` with the merged out/LSE), or
torch's cuDNN SDPA ops, or its flash ops. A kernel that cannot take a shape is passed over by a
check (`refusal`), never by an exception caught: the next one runs (fa4 -> cudnn -> flash -> math),
logged once with the reason, and a kernel's own error is the caller's. Otherwise (CPU,
float32/float64 on any device, or kernel math) a plain math path, which materialises the score
matrix, is meant for tests and small problems, and refuses calls past MATH_MAX_SCORE_BYTES.

Layouts: q [b, hq, sq, d]; k, v [b, hk, sk, d] with hk dividing hq (GQA is native everywhere:
K/V are never repeated); any strides with a unit last stride. lse is [b, hq, sq], float32
(float64 for float64 inputs).
"""

from __future__ import annotations

import logging
import os

import torch

from models.attention import kernels
from models.attention.rope import triton
from models.errors import AttentionTooLarge

if triton is not None:
    import triton.language as tl

log = logging.getLogger(__name__)

# (kernel asked for, kernel that ran, why) of every fallback so far; public so benchmarks and
# GPU tests can report it
FALLBACKS: set[tuple[str, str, str]] = set()
_CUDNN_LSE_DIMS = [4]  # rank of the LSE the cuDNN forward returns; its backward wants the same
# The most bytes the math path's S x S scores of one call may take (its backward holds about
# three such tensors): past it the call is refused, in one line, rather than swapping or dying
# in the allocator.
MATH_MAX_SCORE_BYTES = 8 << 30

# The kernel setting -> the kernels to try, in order, before math.
_ORDER = {"fa4": ("fa4", "cudnn", "flash"), "cudnn": ("cudnn", "flash"), "flash": ("flash",),
          "math": ()}


def refusal(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why kernel `name` (fa4, cudnn, flash) cannot take these CUDA fp16/bf16 inputs, or None:
    the checks the kernels would otherwise fail on (head dim, strides, alignment)."""
    head_dim = q.shape[-1]
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        return "a last stride other than 1"
    if name == "fa4":
        if not kernels.fa4_takes_head_dim(head_dim) or head_dim > 256:
            return f"head dim {head_dim} (FA4 here: multiples of 32 up to 128, or up to 256)"
        elements = 16 // q.element_size()  # FA4 loads 16-byte vectors
        if any(x.data_ptr() % 16 or any(st % elements for st in x.stride()[:-1])
               for x in (q, k, v)):
            return "inputs not 16-byte aligned"
        return None
    if head_dim % 8:
        return f"head dim {head_dim} not a multiple of 8"
    if head_dim > (128 if name == "cudnn" else 256):
        return f"head dim {head_dim} above {128 if name == 'cudnn' else 256}"
    return None


def _fused(q: torch.Tensor) -> bool:
    """Whether a fused kernel may run q: CUDA fp16/bf16."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The kernel that runs these inputs: the run's kernel where it takes them, else the next
    that does (each fallback logged once, with its reason), else math; math on CPU and for
    float32/float64."""
    if not _fused(q):
        return "math"
    wanted = kernels.active()
    reasons = []
    for name in _ORDER[wanted]:
        why = refusal(name, q, k, v)
        if why is None:
            if reasons:
                _fell_back(wanted, name, "; ".join(reasons))
            return name
        reasons.append(f"{name}: {why}")
    if reasons:
        _fell_back(wanted, "math", "; ".join(reasons))
    return "math"


def _fell_back(wanted: str, taken: str, why: str) -> None:
    if (wanted, taken, why) not in FALLBACKS:
        FALLBACKS.add((wanted, taken, why))
        log.warning("attention kernel %s cannot take a call (%s): %s runs it", wanted, why, taken)


def check_math_size(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse a math-path call whose scores [b, hq, sq, sk] exceed MATH_MAX_SCORE_BYTES."""
    size = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * (
        8 if q.dtype == torch.float64 else 4)
    if size > MATH_MAX_SCORE_BYTES:
        raise AttentionTooLarge(
            f"attention on the math path over {q.shape[2]} x {k.shape[2]} scores of "
            f"{q.shape[0] * q.shape[1]} heads needs {size / 2**30:.1f} GiB for its scores alone "
            f"(bound {MATH_MAX_SCORE_BYTES >> 30} GiB): run it on a GPU in bf16 (a fused "
            "kernel), or with shorter sequences or fewer tokens per batch")


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (out [b, hq, sq, d], lse [b, hq, sq]).

    `causal` masks key j > query i (top-left aligned; callers use it only with sq == sk).
    """
    name = _backend(q, k, v)
    if name == "math":
        check_math_size(q, k)
        return _math_forward(q, k, v, causal, scale)
    return _FORWARDS[name](q, k, v, causal, scale)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of softmax attention, given the (possibly merged) out and lse.

    dout and out must have q's layout; lse must be contiguous.
    """
    name = _backend(q, k, v)
    if name == "math":
        check_math_size(q, k)
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    return _BACKWARDS[name](dout, q, k, v, out, lse, causal, scale)


def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    _CUDNN_LSE_DIMS[0] = lse.dim()
    return out, lse.reshape(q.shape[:3])  # [b, h, s, 1] -> [b, h, s]


def _cudnn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _CUDNN_LSE_DIMS[0] == 4:
        lse = lse.unsqueeze(-1)
    # Dropout is off, so the philox seed/offset are never read; cuDNN caches its graph by the
    # q/k/v layout only, which is why out/dout must share q's layout and lse be contiguous.
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, seed, None, None, None, q.shape[2], k.shape[2],
        0.0, causal, scale=scale)
    return dq, dk, dv


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.empty(2, dtype=torch.int64, device=q.device)  # dropout off: never read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng[0],
        scale=scale)
    return dq, dk, dv


_FORWARDS = {"fa4": kernels.fa4_forward, "cudnn": _cudnn_forward, "flash": _flash_forward}
_BACKWARDS = {"fa4": kernels.fa4_backward, "cudnn": _cudnn_backward, "flash": _flash_backward}


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
                 acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped q [b, hk, g, sq, d] and scaled, masked scores [b, hk, g, sq, sk] in `acc`."""
    hk = k.shape[1]
    qg = q.unflatten(1, (hk, q.shape[1] // hk)).to(acc)  # [b, hk, g, sq, d]
    scores = qg @ k.unsqueeze(2).to(acc).transpose(-1, -2) * scale  # [b, hk, g, sq, sk]
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return qg, scores


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """What lse and the math path's sums take for inputs like x: float64 for float64 (the
    reference tests), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q)
    _, scores = _math_scores(q, k, causal, scale, acc)
    lse = scores.logsumexp(dim=-1)  # [b, hk, g, sq]
    probs = (scores - lse.unsqueeze(-1)).exp()
    out = probs @ v.unsqueeze(2).to(acc)  # [b, hk, g, sq, d]
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q)
    hk = k.shape[1]
    qg, scores = _math_scores(q, k, causal, scale, acc)
    # P from the given lse: with a merged lse this is the global softmax restricted to these keys.
    probs = (scores - lse.unflatten(1, (hk, -1)).to(acc).unsqueeze(-1)).exp()
    do = dout.unflatten(1, (hk, -1)).to(acc)  # [b, hk, g, sq, d]
    o = out.unflatten(1, (hk, -1)).to(acc)
    kk, vv = k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)  # [b, hk, 1, sk, d]
    delta = (do * o).sum(dim=-1, keepdim=True)  # [b, hk, g, sq, 1]
    ds = probs * (do @ vv.transpose(-1, -2) - delta) * scale  # [b, hk, g, sq, sk]
    dq = (ds @ kk).flatten(1, 2)
    dk = (ds.transpose(-1, -2) @ qg).sum(dim=2)  # groups share one K head
    dv = (probs.transpose(-1, -2) @ do).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor,
                   lse: torch.Tensor) -> None:
    """Merge partial attention results over disjoint key sets, in place.

    outs: 1 to 3 tensors [s, h, d]; lses: matching [h, s]; any strides with a unit last stride
    on outs. Writes out [s, h, d] (its dtype) and lse [h, s]; arithmetic in float32 (float64 for
    float64 lse).
    """
    if not 1 <= len(outs) <= 3:
        raise ValueError(f"merge_partials takes 1 to 3 parts, got {len(outs)}")
    if triton is None or lse.dtype == torch.float64 or not (
            out.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        stacked = torch.stack(lses)  # [p, h, s]
        total = stacked.logsumexp(dim=0)
        weights = (stacked - total).exp().transpose(1, 2).unsqueeze(-1)  # [p, s, h, 1]
        merged = sum(w * o.to(total.dtype) for w, o in zip(weights, outs))
        out.copy_(merged)
        lse.copy_(total)
        return
    s, h, d = out.shape
    o = list(outs) + [outs[0]] * (3 - len(outs))  # unused slots: never read (NUM)
    ls = list(lses) + [lses[0]] * (3 - len(lses))
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    block_s = max(1, 4096 // (block_h * block_d))
    _merge_kernel[(triton.cdiv(s, block_s),)](
        o[0], o[1], o[2], ls[0], ls[1], ls[2], out, lse, s, h, d,
        o[0].stride(0), o[0].stride(1), o[1].stride(0), o[1].stride(1),
        o[2].stride(0), o[2].stride(1), ls[0].stride(0), ls[0].stride(1),
        ls[1].stride(0), ls[1].stride(1), ls[2].stride(0), ls[2].stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM=len(outs), BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=8,
    )


if triton is not None:

    @triton.jit
    def _merge_kernel(o0, o1, o2, l0, l1, l2, out_ptr, lse_ptr, S, H, D,
                      o0s, o0h, o1s, o1h, o2s, o2h, l0h, l0s, l1h, l1s, l2h, l2s,
                      sos, soh, slh, sls,
                      NUM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        # One program: BLOCK_S rows x all heads; each part's out is read exactly once.
        tok = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)  # [BS]
        head = tl.arange(0, BLOCK_H)
        dim = tl.arange(0, BLOCK_D)
        row_mask = (tok < S)[:, None] & (head < H)[None, :]  # [BS, BH]
        mask = row_mask[:, :, None] & (dim < D)[None, None, :]
        # Masked rows get lse 0 (not -inf) so no NaN is formed; they are never stored.
        a = tl.load(l0 + head[None, :] * l0h + tok[:, None] * l0s, mask=row_mask, other=0.0)
        m = a
        if NUM > 1:
            b = tl.load(l1 + head[None, :] * l1h + tok[:, None] * l1s, mask=row_mask, other=0.0)
            m = tl.maximum(m, b)
        if NUM > 2:
            c = tl.load(l2 + head[None, :] * l2h + tok[:, None] * l2s, mask=row_mask, other=0.0)
            m = tl.maximum(m, c)
        w = tl.exp(a - m)
        total = w
        off = tok[:, None, None] * o0s + head[None, :, None] * o0h + dim[None, None, :]
        acc = w[:, :, None] * tl.load(o0 + off, mask=mask, other=0.0).to(tl.float32)
        if NUM > 1:
            w = tl.exp(b - m)
            total += w
            off = tok[:, None, None] * o1s + head[None, :, None] * o1h + dim[None, None, :]
            acc += w[:, :, None] * tl.load(o1 + off, mask=mask, other=0.0).to(tl.float32)
        if NUM > 2:
            w = tl.exp(c - m)
            total += w
            off = tok[:, None, None] * o2s + head[None, :, None] * o2h + dim[None, None, :]
            acc += w[:, :, None] * tl.load(o2 + off, mask=mask, other=0.0).to(tl.float32)
        acc = acc / total[:, :, None]
        off = tok[:, None, None] * sos + head[None, :, None] * soh + dim[None, None, :]
        tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + head[None, :] * slh + tok[:, None] * sls, m + tl.log(total),
                 mask=row_mask)
