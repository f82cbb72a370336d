"""longctx's attention variants over a KV cache, in plain torch (shipped inside model exports).

Layout [batch, heads, seq, head_dim]; K/V may have fewer heads (GQA: K/V head j serves query
heads j * g .. j * g + g - 1). Key j sits at position j. The sq queries sit at consecutive
positions: by default the last sq of the sk keys (a prefill has sq == sk, a decoding step
sq == 1); with `positions` (their positions, a tensor) they may sit anywhere, as with a static
cache, whose keys are its whole preallocated buffer: keys at later positions than a query's are
masked either way (a buffer's unused rows must be finite, as a static cache's zeros are: a
decoding step multiplies them by zero probabilities).

Prefill (sq > 1) is a few dense attention calls over whole chunks: chunked attention one causal
call with the chunks batched; DCA three key parts (intra: the query chunks batched, causal;
successive: the same chunks against their previous ones, batched, full; inter: per query chunk,
its keys before the previous chunk, full) merged by their log-sum-exp (LSE): the union of key
sets under one softmax is each part's output weighted by exp(lse_part - lse_union); standard
attention after a cache likewise (the cached keys full, the new ones causal). Queries are padded
to whole chunks (zero rows, outputs dropped), so a chunk of new queries against a cache is the
same computation as a whole prompt. The LSE-returning calls are aten's fused kernels, as SDPA's
backend switches allow (cuDNN on Hopper or later, else flash, on CUDA fp16/bf16; flash on CPU;
memory-efficient on CUDA fp32), else a math fallback (float64, say). Non-causal calls fold each
K/V head's query heads into rows ([b, hk, g * rows, d]): K/V are never repeated. A prefill with
`positions` reads the first one on the host (one sync): it decides which chunks are computed.
Measured on an H200 (torch 2.11, bf16, 32K tokens, 32 query / 8 K/V heads, head dim 128, C 8192,
w 1024): 24 ms (38 ms with flash instead of cuDNN), against 256 ms for the per-1024-row loop this
replaced and 14 ms for one causal cuDNN call over the same tokens.

Decoding (sq == 1) is one batched matmul over every cached key, masked by position, with no
data-dependent Python control flow, so torch.compile and CUDA graphs capture it.

Dual Chunk Attention (An et al. 2024) with chunk length L = chunk_size - local_size: a key at
position j is rotated to r_j = j mod L (so the cache holds keys rotated once); a query at position
i in chunk n = i div L meets keys of its own chunk rotated to r_i (intra, causal), the previous
chunk's rotated to min(r_i + L, chunk_size) (successive) and older ones rotated to
min(2L - 1, chunk_size) (inter), all in one softmax.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., s, d] rotated by cos, sin [s, d] (rotate-half), computed in float32 or wider."""
    wide = torch.promote_types(x.dtype, cos.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.mul(x, cos.to(wide))  # the products in `wide` (x read once, not copied first)
    return out.addcmul_(torch.cat([-x2, x1], dim=-1), sin.to(wide)).to(x.dtype)


def dca_positions(pos: torch.Tensor, chunk_size: int,
                  local_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE positions of tokens at `pos` as (keys and intra-chunk queries, successive-chunk
    queries, inter-chunk queries)."""
    length = chunk_size - local_size
    r = pos % length
    return r, torch.clamp(r + length, max=chunk_size), torch.full_like(r, min(2 * length - 1,
                                                                             chunk_size))


# ---- dense attention that returns its log-sum-exp -------------------------------------------

@functools.lru_cache
def _capability(index: int | None) -> tuple[int, int]:
    """The compute capability of CUDA device `index`."""
    return torch.cuda.get_device_capability(index)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores materialised, in float32 or wider (any device and dtype; equal head counts)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    if causal:
        m, n = scores.shape[-2:]
        future = torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.to(wide)).to(q.dtype), lse


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one call, K/V heads dividing the query heads. The fused kernels are those
    SDPA would pick, as its backend switches (torch.backends.cuda.*_sdp_enabled) allow."""
    d, gqa = q.shape[-1], q.shape[1] != k.shape[1]
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        # its query heads may be a multiple of the K/V heads (GQA inside the kernel)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    fused = q.is_cuda and d % 8 == 0
    half = fused and q.dtype in (torch.float16, torch.bfloat16)
    if half and d <= 128 and _capability(q.device.index) >= (9, 0) \
            and torch.backends.cuda.cudnn_sdp_enabled():
        try:  # cuDNN: 1.5x flash's speed on Hopper (an H200, torch 2.11); GQA inside
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
            return out, lse.reshape(q.shape[:3])  # its LSE is [B, H, M, 1]
        except RuntimeError:  # a shape or build cuDNN does not take: flash below
            pass
    if half and d <= 256 and _capability(q.device.index) >= (8, 0) \
            and torch.backends.cuda.flash_sdp_enabled():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(  # GQA inside, as FA2's
            q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if gqa:  # only causal calls get here with GQA (see _attend): repeated K/V, for kernels
        g = q.shape[1] // k.shape[1]  # without GQA, a chunk's keys at a time
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if fused and q.dtype in (torch.float32, torch.float16) \
            and torch.backends.cuda.mem_efficient_sdp_enabled():
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[2]]  # its LSE rows are padded to a multiple of 32
    return _math(q, k, v, causal, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, hq, M, d] over k, v [B, hk, N, d] (causal: M == N, query i sees keys
    0..i) and its LSE [B, hq, M] (float32, or float64 for float64 inputs)."""
    b, hq, m, d = q.shape
    hk = k.shape[1]
    if hk != hq and not causal:  # the g query heads of a K/V head as g * M rows of one head
        out, lse = _kernel(q.reshape(b, hk, -1, d), k, v, False, scale)
        return out.reshape(b, hq, m, d), lse.reshape(b, hq, m)
    return _kernel(q, k, v, causal, scale)


def _merge(parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Outputs of disjoint key parts merged into those of their union under one softmax:
    lse = logsumexp_p lse_p, out = sum_p exp(lse_p - lse) * out_p. Each part is (first index
    along dim 1, out [b, n_p, ..., d], lse [b, n_p, ...]); the first part spans all of dim 1.
    Returns float32 (float64 for float64 parts), each part read once."""
    total = parts[0][2].to(torch.promote_types(parts[0][2].dtype, torch.float32), copy=True)
    for first, _, lse in parts[1:]:
        seg = total[:, first:first + lse.shape[1]]
        seg.copy_(torch.logaddexp(seg, lse))
    acc = parts[0][1] * torch.exp(parts[0][2] - total)[..., None]
    for first, out, lse in parts[1:]:
        n = lse.shape[1]
        acc[:, first:first + n].addcmul_(out, torch.exp(lse - total[:, first:first + n])[..., None])
    return acc


# ---- layout helpers --------------------------------------------------------------------------

def _start(sq: int, sk: int, positions: torch.Tensor | None) -> int:
    """Position of the first query: the last sq of sk, or positions[0] (read on the host)."""
    return sk - sq if positions is None else int(positions.reshape(-1)[0])


def _last(sk: int, positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The one decoding query's position as a [1] tensor (no host sync)."""
    if positions is None:
        return torch.full((1,), sk - 1, dtype=torch.long, device=device)
    return positions.reshape(-1)[:1].to(device=device, dtype=torch.long)


def _chunked(x: torch.Tensor, before: int, after: int, length: int) -> torch.Tensor:
    """x [b, h, s, d] with `before` zero rows prepended and `after` appended, as whole chunks
    of `length` rows, chunk-major: [b, n, h, length, d] (contiguous)."""
    x = F.pad(x, (0, 0, before, after))
    return x.unflatten(2, (-1, length)).transpose(1, 2).contiguous()


def _unchunked(x: torch.Tensor, offset: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, n, h, length, d] chunk-major -> rows offset..offset+rows of [b, h, n * length, d] in
    `dtype` (one copy)."""
    b, n, h, length, d = x.shape
    out = torch.empty(b, h, n, length, d, dtype=dtype, device=x.device)
    out.copy_(x.transpose(1, 2))
    return out.flatten(2, 3)[:, :, offset:offset + rows]


# ---- the variants -------------------------------------------------------------------------

def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, hq, 1, d] -> [b, hk, g, d]: one decoding query's heads as rows of their K/V head."""
    return q.reshape(q.shape[0], kv_heads, -1, q.shape[-1])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     chunk_size: int | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [b, hq, sq, d] over k, v [b, hk, sk, d]; with `chunk_size`, a query
    sees only the keys of its own chunk (Llama 4's chunked layers). `positions` [sq]: the
    queries' positions when they are not the last sq keys'. Returns [b, hq, sq, d]."""
    b, hq, sq, d = q.shape
    sk, gqa = k.shape[2], hq != k.shape[1]
    if sq == 1:  # decoding: every key, masked by position (static shapes)
        pos = _last(sk, positions, q.device)
        j = torch.arange(sk, device=q.device)
        visible = j <= pos
        if chunk_size:
            visible = visible & (j // chunk_size == pos // chunk_size)
        out = F.scaled_dot_product_attention(_grouped(q, k.shape[1]), k, v,
                                             attn_mask=visible[None], scale=scale)
        return out.reshape(b, hq, 1, d)
    start = _start(sq, sk, positions)
    end = start + sq
    if chunk_size:  # whole chunks batched into one causal call
        c0, n1 = start // chunk_size * chunk_size, -(-end // chunk_size)
        pad = n1 * chunk_size - end
        qc = _chunked(q, start - c0, pad, chunk_size)
        kc, vc = (_chunked(x[:, :, c0:end], 0, pad, chunk_size) for x in (k, v))
        out = F.scaled_dot_product_attention(qc.flatten(0, 1), kc.flatten(0, 1),
                                             vc.flatten(0, 1), is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return _unchunked(out.unflatten(0, (b, -1)), start - c0, sq, q.dtype)
    if start == 0:  # a whole prompt: one fused causal call
        return F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    # new queries after a cache: all cached keys (full) and the new ones (causal), merged
    new = _attend(q, k[:, :, start:end], v[:, :, start:end], causal=True, scale=scale)
    cached = _attend(q, k[:, :, :start], v[:, :, :start], causal=False, scale=scale)
    return _merge([(0, *new), (0, *cached)]).to(q.dtype)


def dca_attention(q: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, *, chunk_size: int,
                  local_size: int, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                  positions: torch.Tensor | None = None,
                  factors: torch.Tensor | None = None) -> torch.Tensor:
    """Dual Chunk Attention of q [b, hq, sq, d] (unrotated) over k_rot [b, hk, sk, d] (each key
    rotated to r_j) and v; cos, sin [chunk_size + 1, d] are the RoPE tables of positions
    0..chunk_size (any attention factor included); `positions` as in causal_attention;
    `factors` [3, sq] float32: each query's logit factor for its own chunk's, the previous
    chunk's and older keys (None: all 1), multiplied into the rotated query.
    Returns [b, hq, sq, d]."""
    length = chunk_size - local_size
    if q.shape[2] == 1:
        return _dca_decode(q, k_rot, v, _last(k_rot.shape[2], positions, q.device), length,
                           chunk_size, local_size, cos, sin, scale, factors)
    return _dca_prefill(q, k_rot, v, _start(q.shape[2], k_rot.shape[2], positions), length,
                        chunk_size, local_size, cos, sin, scale, factors)


def _dca_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                length: int, chunk_size: int, local_size: int, cos: torch.Tensor,
                sin: torch.Tensor, scale: float, factors: torch.Tensor | None) -> torch.Tensor:
    """One query at position pos [1]: rotated three ways, scored against every key in one
    matmul; each key takes the score of its chunk's relation to the query's, later keys are
    masked, and one softmax spans them all."""
    b, hq, _, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    three = torch.cat(dca_positions(pos, chunk_size, local_size))  # [3]: intra, succ, inter
    c, s = cos[three], sin[three]
    if factors is not None:  # [3, 1]: the parts' factors scale their table rows
        c, s = c * factors.to(c.dtype), s * factors.to(s.dtype)
    q3 = rotate(q.expand(b, hq, 3, d), c, s)  # [b, hq, 3, d]
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (torch.matmul(q3.reshape(b, hk, -1, d), k.transpose(-1, -2)).to(wide)
              * scale).unflatten(2, (-1, 3))  # [b, hk, g, 3, sk]
    j = torch.arange(sk, device=q.device)
    part = (pos // length - j // length).clamp(0, 2)  # 0 own chunk, 1 previous, 2 older
    scores = scores.gather(3, part.expand(*scores.shape[:3], 1, sk)).squeeze(3)
    probs = torch.softmax(scores.masked_fill(j > pos, float("-inf")), dim=-1)
    return torch.matmul(probs.to(v.dtype), v).reshape(b, hq, 1, d)  # [b, hk, g, d] -> heads


def _dca_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, length: int,
                 chunk_size: int, local_size: int, cos: torch.Tensor, sin: torch.Tensor,
                 scale: float, factors: torch.Tensor | None) -> torch.Tensor:
    """Queries at start..start+sq-1 as the union of three key parts, merged by LSE: intra (the
    query chunks batched, one causal call), successive (the same chunks batched against their
    previous ones, one full call) and inter (per query chunk n >= 2, one full call over keys
    0..(n-1)L - 1: a loop over chunks, S / L calls)."""
    b, hq, sq, d = q.shape
    end = start + sq
    n0, n1 = start // length, -(-end // length)  # the query chunks n0..n1-1
    c0, pad = n0 * length, n1 * length - end
    k0 = max(n0 - 1, 0)  # the key chunks k0..n1-1 serve intra and successive
    qc = _chunked(q, start - c0, pad, length)  # [b, nq, hq, L, d]
    kc, vc = (_chunked(x[:, :, k0 * length:end], 0, pad, length) for x in (k, v))
    # every chunk's rows have the same three rotations: tables [L, d], times each query's
    # factor per part: fc [1, nq, 3, L, 1] (chunked as q)
    intra, succ, inter = dca_positions(torch.arange(length, device=q.device), chunk_size,
                                       local_size)
    fc = (None if factors is None else
          _chunked(factors.to(cos.dtype)[None, :, :, None], start - c0, pad, length))

    def tables(rows: torch.Tensor, part: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        if fc is None:
            return cos[rows], sin[rows]
        f = fc[:, first:, part:part + 1]  # [1, n, 1, L, 1] of the query chunks first..
        return cos[rows] * f, sin[rows] * f

    # intra: causal within each chunk; expanding K/V per chunk (in _kernel) is acceptable for
    # the backends without GQA: folding query heads into rows would break the causal mask
    out, lse = _attend(rotate(qc, *tables(intra, 0, 0)).flatten(0, 1),
                       kc[:, n0 - k0:].flatten(0, 1), vc[:, n0 - k0:].flatten(0, 1),
                       causal=True, scale=scale)
    parts = [(0, out.unflatten(0, (b, -1)), lse.unflatten(0, (b, -1)))]  # [b, nq, hq, L, ...]
    s0 = max(n0, 1)  # successive: chunks s0..n1-1 against chunks s0-1..n1-2, all keys
    if s0 < n1:
        qs = rotate(qc[:, s0 - n0:], *tables(succ, 1, s0 - n0)).flatten(0, 1)
        ks, vs = (x[:, s0 - 1 - k0:n1 - 1 - k0].flatten(0, 1) for x in (kc, vc))
        out, lse = _attend(qs, ks, vs, causal=False, scale=scale)
        parts.append((s0 - n0, out.unflatten(0, (b, -1)), lse.unflatten(0, (b, -1))))
    i0 = max(n0, 2)  # inter: chunk n against every key before chunk n - 1
    if i0 < n1:
        qi = rotate(qc[:, i0 - n0:], *tables(inter, 2, i0 - n0))
        for n in range(i0, n1):
            keys = (n - 1) * length
            out, lse = _attend(qi[:, n - i0], k[:, :, :keys], v[:, :, :keys], causal=False,
                               scale=scale)
            parts.append((n - n0, out[:, None], lse[:, None]))
    return _unchunked(_merge(parts), start - c0, sq, q.dtype)
