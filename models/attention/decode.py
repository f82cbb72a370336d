"""Decode attention: one new query per sequence against a long, preallocated KV cache.

`decode_attention` serves the three attention kinds of a decoding step (standard causal, chunked
as Llama 4's chunked layers, Dual Chunk Attention) for a batch of sequences of different lengths
held in one static cache [b, hk, S_max, d]. Sequence i's valid keys are 0..lengths[i]-1 and its
query sits at position lengths[i]-1 (its own key already written). `lengths` stays on the device
and is never read on the host, so a CUDA graph captured once replays at any lengths: every shape,
launch grid and branch below depends on shapes alone.

Two paths, chosen in one place (`decode_attention`):
- Triton split-K kernels (decode_kernels.py) on CUDA for fp16/bf16: decode is memory-bound, so
  the keys are cut into ranges that together fill the GPU, each program reads its K/V once for
  all the query heads of its K/V head (GQA: never repeated), and the ranges merge by their LSE.
- A vectorised torch path (`decode_attention_reference`) everywhere else (CPU, float32/64) and
  as the reference the kernels are tested against: no loop over keys, static shapes, masks built
  from torch.arange and lengths on the device, so it is graph-capturable too.

DCA (An et al. 2024; chunk length L = chunk_size - local_size): cached keys hold their in-chunk
rotation r_j = j mod L. The query at i = lengths-1 (chunk n_i = i div L, r_i = i mod L) is rotated
to r_i for keys of its own chunk, to min(r_i + L, chunk_size) for the previous chunk's and to
min(2L - 1, chunk_size) for older ones; one softmax spans all of them.
"""

from __future__ import annotations

import torch

from models.attention import decode_kernels
from models.attention.registry import variant

__all__ = ["decode_attention", "decode_attention_reference"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, scale: float, kind: str,
                     chunk_size: int | None = None, local_size: int | None = None,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     factors: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its valid cached keys.

    Args:
        q: [b, hq, d] the new token's query: unrotated for "dca", already rotated (megatron's
            rotate-half RoPE at its position) for "standard" and "chunked".
        k_cache, v_cache: [b, hk, S_max, d]; hk divides hq. Keys rotated at their positions
            ("standard", "chunked") or to r_j = j mod L ("dca"). Entries at positions >= lengths
            are never read (they may hold anything, NaN included).
        lengths: [b] int32/int64 on q's device, 1 <= lengths <= S_max; never read on the host.
        scale: softmax scale of the scores.
        kind: "standard" (all valid keys), "chunked" (keys at positions >= (pos // chunk_size)
            * chunk_size only) or "dca".
        chunk_size: the chunk of "chunked" and "dca"; local_size: DCA's w (L = chunk_size - w).
        cos, sin: [chunk_size + 1, d] float32 RoPE tables of positions 0..chunk_size ("dca").
        factors: [b, 3] float32 logit factors of each row's query for DCA's own-chunk, previous
            chunk and older keys (attention.dca_scaling; models/attention/dca/scaling.py), or
            None (all 1). They multiply the rotated query before its rounding to q's dtype.

    Returns:
        [b, hq, d] in q's dtype.
    """
    _validate(q, k_cache, v_cache, lengths, kind, chunk_size, local_size, cos, sin, factors)
    if _use_triton(q, k_cache, v_cache):
        return _triton_decode(q, k_cache, v_cache, lengths, scale=scale, kind=kind,
                              chunk_size=chunk_size, local_size=local_size, cos=cos, sin=sin,
                              factors=factors)
    return decode_attention_reference(q, k_cache, v_cache, lengths, scale=scale, kind=kind,
                                      chunk_size=chunk_size, local_size=local_size, cos=cos,
                                      sin=sin, factors=factors)


def _use_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernels run on CUDA, in fp16/bf16, at power-of-two head dims up to 256, over caches
    whose last dim is contiguous; anything else takes the torch path."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and decode_kernels.supports(q.shape[-1])
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def _triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   lengths: torch.Tensor, *, scale: float, kind: str,
                   chunk_size: int | None = None, local_size: int | None = None,
                   cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                   factors: torch.Tensor | None = None, num_splits: int | None = None,
                   block_n: int | None = None) -> torch.Tensor:
    """The split-K kernels (also on CPU tensors under TRITON_INTERPRET=1, for tests).

    num_splits and block_n default to `decode_kernels`' choices, functions of the shapes and the
    GPU alone; tests pass their own to cover empty ranges and partial blocks.
    """
    b, hk, s_max, d = k_cache.shape
    if num_splits is None:
        window = decode_kernels.key_window(kind, s_max, chunk_size)
        num_splits = decode_kernels.default_num_splits(window, b * hk, q.device)
    if block_n is None:
        block_n = decode_kernels.default_block_n(d)
    return decode_kernels.decode_splitk(
        q, k_cache, v_cache, lengths, scale=scale, kind=kind, chunk_size=chunk_size,
        local_size=local_size, cos=cos, sin=sin, factors=factors, num_splits=num_splits,
        block_n=block_n)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE x*cos + cat(-x2, x1)*sin, in x's dtype (callers pass a wide x)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, *, scale: float, kind: str,
                               chunk_size: int | None = None, local_size: int | None = None,
                               cos: torch.Tensor | None = None,
                               sin: torch.Tensor | None = None,
                               factors: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of `decode_attention` (same arguments and result), vectorised over keys.

    Computes in float32 (float64 for float64 inputs). Like the plain-torch model export
    (ckpt/remote_code/longctx_attention.py), DCA's rotated queries are rounded to q's dtype
    before their scores, as the kernels' bf16 matrix products do. Costs a wide copy of the cache
    and [b, hq, 3, S_max] scores: a reference and a CPU path, not the fast one.
    """
    _validate(q, k_cache, v_cache, lengths, kind, chunk_size, local_size, cos, sin, factors)
    b, hq, d = q.shape
    hk, s_max = k_cache.shape[1], k_cache.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    pos = lengths.to(torch.long) - 1  # [b] query positions
    keys = torch.arange(s_max, device=q.device)  # [S]
    valid = keys[None, :] <= pos[:, None]  # [b, S]
    if kind == "chunked":
        valid = valid & (keys[None, :] >= (pos // chunk_size * chunk_size)[:, None])
    k = k_cache.to(wide)  # [b, hk, S, d]
    # masked, not multiplied by a zero weight: padding may hold NaN or inf
    v = torch.where(valid[:, None, :, None], v_cache.to(wide), 0)
    qg = q.to(wide).unflatten(1, (hk, -1))  # [b, hk, g, d]
    if kind == "dca":
        span = chunk_size - local_size
        r = pos % span
        rows = torch.stack([r, (r + span).clamp(max=chunk_size),
                            torch.full_like(r, min(2 * span - 1, chunk_size))], dim=1)  # [b, 3]
        c = cos.to(wide)[rows][:, None, None]  # [b, 1, 1, 3, d]
        s = sin.to(wide)[rows][:, None, None]
        q3 = _rotate(qg[:, :, :, None], c, s)  # [b, hk, g, 3, d]
        if factors is not None:
            q3 = q3 * factors.to(wide)[:, None, None, :, None]
        q3 = q3.to(q.dtype).to(wide)
        scores3 = torch.einsum("bhgtd,bhsd->bhgts", q3, k)  # [b, hk, g, 3, S]
        # 0: the query's chunk, 1: the previous one, 2: older (later keys: masked anyway)
        relation = (pos[:, None] // span - keys[None, :] // span).clamp(0, 2)  # [b, S]
        index = relation[:, None, None, None, :].expand(b, hk, hq // hk, 1, s_max)
        scores = scores3.gather(3, index).squeeze(3)  # [b, hk, g, S]
    else:
        scores = torch.einsum("bhgd,bhsd->bhgs", qg, k)  # [b, hk, g, S]
    scores = (scores * scale).masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v)  # [b, hk, g, d]
    return out.flatten(1, 2).to(q.dtype)


def _validate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              lengths: torch.Tensor, kind: str, chunk_size: int | None, local_size: int | None,
              cos: torch.Tensor | None, sin: torch.Tensor | None,
              factors: torch.Tensor | None) -> None:
    """Shape and argument checks (shapes only: lengths' values stay on the device)."""
    variant(kind)  # ValueError naming the registered kinds for any other
    decode_kernels.kernel_kind(kind)  # NotImplementedError for a kind decode does not serve
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [b, hq, d] and k_cache = v_cache [b, hk, S_max, d], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % k_cache.shape[1] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
                         "(same batch and head dim; K/V heads must divide query heads)")
    if d % 2:
        raise ValueError(f"head dim must be even (rotate-half RoPE), got {d}")
    if lengths.shape != (b,) or lengths.dtype not in (torch.int32, torch.int64) \
            or lengths.device != q.device:
        raise ValueError(f"lengths must be a [{b}] int32/int64 tensor on {q.device}, got "
                         f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}")
    if kind != "standard" and (chunk_size is None or chunk_size < 1):
        raise ValueError(f"kind {kind!r} needs a positive chunk_size, got {chunk_size}")
    if kind == "dca":
        if local_size is None or not 0 <= local_size < chunk_size:
            raise ValueError(f"DCA needs 0 <= local_size < chunk_size, got {local_size} "
                             f"and {chunk_size}")
        for name, table in (("cos", cos), ("sin", sin)):
            if table is None or table.shape != (chunk_size + 1, d):
                raise ValueError(f"DCA needs {name} of shape [{chunk_size + 1}, {d}], got "
                                 f"{None if table is None else tuple(table.shape)}")
    if factors is not None and (kind != "dca" or factors.shape != (b, 3)
                                or factors.device != q.device):
        raise ValueError(f"factors scale DCA's three parts: a [{b}, 3] tensor on {q.device} "
                         f"(kind 'dca'), got {tuple(factors.shape)} on {factors.device} for "
                         f"kind {kind!r}")
