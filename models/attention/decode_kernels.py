"""Triton split-K ("flash decoding") kernels behind `models/attention/decode.py`.

A decoding step has one query per sequence against a long KV cache: far too little work per
sequence for one program, so the keys are cut into `num_splits` contiguous ranges and each
program (one K/V head with all of its g query heads, one range) streams its range once, in blocks
of BLOCK_N keys, with an online softmax in float32. It writes a partial output and its base-2
log-sum-exp to a float32 workspace; a second kernel merges the splits by their LSE.

Everything that depends on a sequence's length is read on the device (loop bounds from the loaded
length), and `num_splits` depends only on the cache size and the GPU, so one CUDA graph captured
at any lengths replays correctly at every other length.

Kinds (`kernel_kind`): 0 standard (keys 0..pos), 1 chunked (keys of the query's own
`CHUNK`-aligned chunk: the ranges cover that chunk alone, from its first key), 2 DCA (three
rotations of the query, one per chunk relation of the key; chunk length SPAN = L).
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: decode.py takes its torch path instead.
    triton = None

# Programs per SM the split count aims for (a few waves hide the ragged ends of the ranges), and
# the fewest keys a split is worth (below that the merge costs more than the parallelism saves).
# These, WARPS, STAGES and default_block_n were the best (or within run-to-run noise of it) of a
# sweep on one H200 (BLOCK_N 32/64/128 x 4/8 warps x 2-4 stages, then 1-8 waves x 128-512 keys)
# over bf16 caches of 32K and 128K keys, head dims 64/128/256, b*hk from 4 to 32: 142 us for
# 8 x 4 heads x 32K x 128 (3.8 TB/s of K and V), as fast as torch's flash SDPA without a mask.
WAVES = 3
MIN_KEYS_PER_SPLIT = 256
MERGE_BLOCK = 32  # splits one merge step reads at a time
WARPS, STAGES = 4, 2  # of the split kernel


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's CPU interpreter: any small count
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_kind(kind: str) -> int:
    """The kernels' KIND of a registered attention kind (models/attention/registry.py holds the
    one list of kinds; this maps those that decode serves)."""
    if kind == "standard":
        return 0
    if kind == "chunked":
        return 1
    if kind == "dca":
        return 2
    raise NotImplementedError(f"decode attention does not serve attention kind {kind!r}")


def default_block_n(head_dim: int) -> int:
    """Keys per block: 64 up to head dim 128, 32 at 256 (keeps a [D, BLOCK_N] tile in registers)."""
    return 64 if head_dim <= 128 else 32


def key_window(kind: str, s_max: int, chunk_size: int | None) -> int:
    """Keys the splits cover: the whole cache, or for "chunked" the query's chunk (the splits
    start at the chunk's first key, found on the device), at most chunk_size keys."""
    return min(s_max, chunk_size) if kind == "chunked" else s_max


def default_num_splits(window: int, programs: int, device: torch.device) -> int:
    """Key ranges for `programs` (batch x K/V heads) programs over a window of `window` keys:
    about WAVES programs per SM, at least MIN_KEYS_PER_SPLIT keys each. A function of the shapes
    and the GPU only (never of lengths), so a captured graph serves every length."""
    wanted = math.ceil(WAVES * _sm_count(device) / programs)
    return max(1, min(wanted, math.ceil(window / MIN_KEYS_PER_SPLIT)))


def supports(head_dim: int) -> bool:
    """Whether the kernels handle this head dim (a power of two from 16 to 256) and Triton is
    installed."""
    return triton is not None and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def decode_splitk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  lengths: torch.Tensor, *, scale: float, kind: str, chunk_size: int | None,
                  local_size: int | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                  num_splits: int, block_n: int,
                  factors: torch.Tensor | None = None) -> torch.Tensor:
    """Split-K decode attention; arguments as `decode.decode_attention` (already validated).

    q: [b, hq, d]; k_cache, v_cache: [b, hk, S_max, d] with unit last stride; lengths: [b] int
    on q's device; cos, sin: [chunk_size + 1, d] float32 and factors [b, 3] float32 or None
    (DCA only). Returns [b, hq, d] in q's dtype. The workspace ([b, hq, num_splits, d] and
    [b, hq, num_splits], float32) is allocated here: under graph capture it comes from the
    graph's private pool.
    """
    b, hq, d = q.shape
    hk, s_max = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    window = key_window(kind, s_max, chunk_size)
    per_split = triton.cdiv(triton.cdiv(window, num_splits), block_n) * block_n
    q = q.contiguous()
    part_out = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    kind_id = kernel_kind(kind)
    # Triton 3.9's CPU interpreter multiplies bf16 dot operands as their raw uint16 bits: there
    # the (already bf16-rounded) operands go to tl.dot as float32, which is exact.
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and q.dtype == torch.bfloat16
    chunk, span = (chunk_size or 1), 1
    if kind_id == 2:
        span = chunk_size - local_size
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    else:
        cos = sin = part_lse  # never read
    scaled = kind_id == 2 and factors is not None
    factors = factors.float().contiguous() if scaled else part_lse  # part_lse: never read
    _split_kernel[(b * hk, num_splits)](
        q, k_cache, v_cache, lengths, cos, sin, factors, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.stride(0), lengths.stride(0),
        hk, group, s_max, per_split, scale * math.log2(math.e),
        KIND=kind_id, SCALED=scaled, CHUNK=chunk, SPAN=span,
        INTER_ROW=min(2 * span - 1, chunk), D=d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", DOT_F32=upcast,
        num_warps=WARPS, num_stages=STAGES,
    )
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    _merge_kernel[(b * hq,)](part_out, part_lse, out, hq, num_splits, out.stride(0),
                             out.stride(1), D=d, BLOCK_S=MERGE_BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _operand(x, dtype, DOT_F32: tl.constexpr):
        # x rounded to the cache's dtype, as a tl.dot operand (float32 again under DOT_F32)
        x = x.to(dtype)
        if DOT_F32:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _rotated(q, q_swapped, cos_ptr, sin_ptr, row, stab, dim):
        # rotate-half RoPE of q [BG, D] to table row `row`: q*cos + cat(-q2, q1)*sin, where
        # q_swapped already holds cat(-q2, q1).
        c = tl.load(cos_ptr + row * stab + dim)
        s = tl.load(sin_ptr + row * stab + dim)
        return q * c[None, :] + q_swapped * s[None, :]

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, cos_ptr, sin_ptr, fac_ptr, o_ptr, lse_ptr,
                      sqb, sqh, skb, skh, sks, svb, svh, svs, stab, slen,
                      HK, G, S_MAX, PER_SPLIT, SCALE_LOG2,
                      KIND: tl.constexpr, SCALED: tl.constexpr, CHUNK: tl.constexpr,
                      SPAN: tl.constexpr,
                      INTER_ROW: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                      DOT_F32: tl.constexpr):
        # One program: sequence bi, K/V head kh with its G query heads, keys
        # base + [split * PER_SPLIT, (split + 1) * PER_SPLIT) clipped to the valid ones, where
        # base is 0, or the first key of the query's chunk (chunked).
        pid = tl.program_id(0)
        split = tl.program_id(1)
        bi = (pid // HK).to(tl.int64)
        kh = (pid % HK).to(tl.int64)
        length = tl.load(len_ptr + bi * slen).to(tl.int32)
        pos = length - 1  # the query's position
        start = split * PER_SPLIT
        if KIND == 1:  # chunked: the splits cover the query's chunk alone
            start += (pos // CHUNK) * CHUNK
        hi = tl.minimum(tl.minimum(start + PER_SPLIT, S_MAX), length)

        g = tl.arange(0, BLOCK_G)
        dim = tl.arange(0, D)
        g_ok = g < G
        q_rows = q_ptr + bi * sqb + (kh * G + g)[:, None] * sqh  # [BG, 1]
        q = tl.load(q_rows + dim[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        dtype = k_ptr.dtype.element_ty
        if KIND == 2:
            # DCA: the query rotated to its in-chunk offset r (own chunk), min(r + L, C)
            # (previous chunk) and min(2L - 1, C) (older chunks), once per program.
            q_sw = tl.load(q_rows + ((dim + D // 2) % D)[None, :], mask=g_ok[:, None],
                           other=0.0).to(tl.float32)
            q_sw = q_sw * tl.where(dim < D // 2, -1.0, 1.0)[None, :]  # cat(-q2, q1)
            r = pos % SPAN
            q_own = _rotated(q, q_sw, cos_ptr, sin_ptr, r, stab, dim)
            q_prev = _rotated(q, q_sw, cos_ptr, sin_ptr, tl.minimum(r + SPAN, CHUNK), stab, dim)
            q_old = _rotated(q, q_sw, cos_ptr, sin_ptr, INTER_ROW, stab, dim)
            if SCALED:  # the parts' logit factors, before the rounding (as the reference)
                q_own = q_own * tl.load(fac_ptr + bi * 3)
                q_prev = q_prev * tl.load(fac_ptr + bi * 3 + 1)
                q_old = q_old * tl.load(fac_ptr + bi * 3 + 2)
            q_own = _operand(q_own, dtype, DOT_F32)
            q_prev = _operand(q_prev, dtype, DOT_F32)
            q_old = _operand(q_old, dtype, DOT_F32)
            q_chunk = pos // SPAN
        else:
            q_own = _operand(q, dtype, DOT_F32)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        k_base = k_ptr + bi * skb + kh * skh
        v_base = v_ptr + bi * svb + kh * svh
        for n0 in range(start, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            ok = offs < hi  # masked loads: padding (even NaN) is never read
            kt = tl.load(k_base + offs[None, :].to(tl.int64) * sks + dim[:, None],
                         mask=ok[None, :], other=0.0, eviction_policy="evict_first")  # [D, BN]
            kt = _operand(kt, dtype, DOT_F32)
            s = tl.dot(q_own, kt, input_precision=PRECISION)  # [BG, BN]
            if KIND == 2:  # the score of the rotation that matches each key's chunk
                s_prev = tl.dot(q_prev, kt, input_precision=PRECISION)
                s_old = tl.dot(q_old, kt, input_precision=PRECISION)
                k_chunk = (offs // SPAN)[None, :]
                s = tl.where(k_chunk == q_chunk, s,
                             tl.where(k_chunk == q_chunk - 1, s_prev, s_old))
            s = tl.where(ok[None, :], s * SCALE_LOG2, float("-inf"))
            # every block visited holds a valid key, so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_base + offs[:, None].to(tl.int64) * svs + dim[None, :],
                         mask=ok[:, None], other=0.0, eviction_policy="evict_first")  # [BN, D]
            acc = acc * alpha[:, None] + tl.dot(_operand(p, dtype, DOT_F32),
                                                _operand(vb, dtype, DOT_F32),
                                                input_precision=PRECISION)
            m_i = m_new

        # an empty range (beyond the length) leaves out 0 and LSE -inf
        filled = l_i > 0
        out = tl.where(filled[:, None], acc / tl.where(filled, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
        n_splits = tl.num_programs(1)
        row = (bi * HK + kh) * G + g  # [BG] rows of [b * hq]
        part = row * n_splits + split
        tl.store(o_ptr + part[:, None] * D + dim[None, :], out, mask=g_ok[:, None])
        tl.store(lse_ptr + part, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(o_ptr, lse_ptr, out_ptr, HQ, NUM_SPLITS, sob, soh, D: tl.constexpr,
                      BLOCK_S: tl.constexpr):
        # One program per (sequence, query head): out = sum_s w_s o_s / sum_s w_s with
        # w_s = 2^(lse_s - max lse); empty splits (LSE -inf) weigh 0.
        row = tl.program_id(0).to(tl.int64)
        dim = tl.arange(0, D)
        sp = tl.arange(0, BLOCK_S)
        top = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            lse = tl.load(lse_ptr + row * NUM_SPLITS + s0 + sp, mask=s0 + sp < NUM_SPLITS,
                          other=float("-inf"))
            top = tl.maximum(top, lse)
        m = tl.max(top, 0)  # finite: the split holding the query's own key is never empty
        acc = tl.zeros([D], tl.float32)
        total = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            ok = s0 + sp < NUM_SPLITS
            lse = tl.load(lse_ptr + row * NUM_SPLITS + s0 + sp, mask=ok, other=float("-inf"))
            w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)  # [BS]
            o = tl.load(o_ptr + (row * NUM_SPLITS + s0 + sp)[:, None] * D + dim[None, :],
                        mask=ok[:, None], other=0.0)  # [BS, D]
            acc += tl.sum(w[:, None] * o, 0)
            total += w
        out = acc / tl.sum(total, 0)
        tl.store(out_ptr + (row // HQ) * sob + (row % HQ) * soh + dim,
                 out.to(out_ptr.dtype.element_ty))
