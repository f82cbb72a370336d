"""The remote code's attention functions (ckpt/remote_code/longctx_attention.py) against
references: the per-block implementation they replaced (kept below, its scores in float64
instead of float32) and a dense masked DCA written from the SPEC's table, in float64 (1e-10);
the LSE kernels against the math fallback; static-buffer queries (`positions`) against exact
key sets; and the decoding step traced as one graph (what torch.compile needs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckpt.remote_code.longctx_attention import (
    _attend,
    _math,
    _merge,
    causal_attention,
    dca_attention,
    dca_positions,
    rotate,
)

C, W = 16, 4  # chunk_size, local_size: L = 12
L = C - W
D = 16
SCALE = 0.3
# (batch, query heads, K/V heads): MHA, GQA 2:1 with a batch, GQA 3:1
HEADS = [(1, 4, 4), (2, 4, 2), (1, 6, 2)]
# whole chunks and partial ones, around the edges L-1, L, L+1 and several chunks
LENGTHS = [5, L - 1, L, L + 1, 2 * L, 2 * L + 1, 3 * L - 1, 64]


def tables(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos, sin [C + 1, D] (theta 10000)."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.arange(C + 1, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qkv(b: int, hq: int, hk: int, sq: int, sk: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, D, generator=g, dtype=dtype),
            torch.randn(b, hk, sk, D, generator=g, dtype=dtype),
            torch.randn(b, hk, sk, D, generator=g, dtype=dtype))


# ---- the implementation the part calls replaced (queries in blocks of rows, one softmax) ----

def _blocks(start: int, rows: int, period: int | None, max_rows: int = 5):
    out, s0 = [], 0
    while s0 < rows:
        s1 = min(rows, s0 + max_rows)
        if period:
            s1 = min(s1, ((start + s0) // period + 1) * period - start)
        out.append((s0, s1))
        s0 = s1
    return out


def _old_causal(q, k, v, *, scale, chunk_size=None):
    sq, sk = q.shape[2], k.shape[2]
    start, out = sk - sq, torch.empty_like(q)
    for s0, s1 in _blocks(start, sq, chunk_size):
        k0 = (start + s0) // chunk_size * chunk_size if chunk_size else 0
        k1 = start + s1
        mask = (torch.arange(k0, k1)[None, :] <= torch.arange(start + s0, start + s1)[:, None])
        out[:, :, s0:s1] = F.scaled_dot_product_attention(
            q[:, :, s0:s1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
    return out


def _old_dca(q, k_rot, v, *, chunk_size, local_size, cos, sin, scale):
    length = chunk_size - local_size
    sq, sk, hk = q.shape[2], k_rot.shape[2], k_rot.shape[1]
    start, out = sk - sq, torch.empty_like(q)
    for s0, s1 in _blocks(start, sq, length):
        pos = torch.arange(start + s0, start + s1)
        c0 = (start + s0) // length * length
        intra, succ, inter = dca_positions(pos, chunk_size, local_size)
        spans = [(intra, c0, start + s1), (succ, max(c0 - length, 0), c0),
                 (inter, 0, max(c0 - length, 0))]
        scores, values = [], []
        for qpos, k0, k1 in spans:
            if k1 <= k0:
                continue
            q_rot = rotate(q[:, :, s0:s1], cos[qpos], sin[qpos]).unflatten(1, (hk, -1))
            scores.append(torch.einsum("bhgrd,bhkd->bhgrk", q_rot, k_rot[:, :, k0:k1])
                          .double() * scale)  # the original's .float(): float64 here
            values.append(v[:, :, k0:k1])
        causal = torch.arange(c0, start + s1)[None, :] <= pos[:, None]
        scores[0] = scores[0].masked_fill(~causal, float("-inf"))
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(v.dtype)
        widths = [s.shape[-1] for s in scores]
        block = sum(torch.einsum("bhgrk,bhkd->bhgrd", p, val)
                    for p, val in zip(probs.split(widths, dim=-1), values))
        out[:, :, s0:s1] = block.flatten(1, 2)
    return out


def _dense_dca(q, k_rot, v, cos, sin):
    """DCA by its definition: every (query, key) score with the rotation of its part, future
    keys masked, one softmax (float64, K/V repeated)."""
    sq, sk = q.shape[2], k_rot.shape[2]
    i = torch.arange(sk - sq, sk)[:, None]
    j = torch.arange(sk)[None, :]
    g = q.shape[1] // k_rot.shape[1]
    k, vv = k_rot.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    rel = (i // L - j // L).clamp(0, 2)  # 0 intra, 1 successive, 2 inter
    scores = torch.zeros(q.shape[0], q.shape[1], sq, sk, dtype=torch.float64)
    for part, qpos in enumerate(dca_positions(i[:, 0], C, W)):
        s = rotate(q, cos[qpos], sin[qpos]) @ k.transpose(-1, -2) * SCALE
        scores = torch.where(rel == part, s, scores)
    return torch.softmax(scores.masked_fill(j > i, float("-inf")), -1) @ vv


def _dca(q, k, v, cos, sin, **kw):
    return dca_attention(q, k, v, chunk_size=C, local_size=W, cos=cos, sin=sin, scale=SCALE,
                         **kw)


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("sk", LENGTHS)
def test_dca_equals_the_blocked_implementation_and_the_definition(heads, sk: int) -> None:
    """A whole prompt (sq == sk), new queries after a cache (sq < sk, starting anywhere in a
    chunk) and one decoding query, in float64."""
    b, hq, hk = heads
    cos, sin = tables()
    for sq in sorted({sk, sk - 1, 1, 2, L - 1, L + 1, 7} - {0}):
        if sq > sk:
            continue
        q, k, v = qkv(b, hq, hk, sq, sk, seed=sk * 100 + sq)
        ours = _dca(q, k, v, cos, sin)
        old = _old_dca(q, k, v, chunk_size=C, local_size=W, cos=cos, sin=sin, scale=SCALE)
        assert (ours - old).abs().max().item() <= 1e-10, (sk, sq)
        assert (ours - _dense_dca(q, k, v, cos, sin)).abs().max().item() <= 1e-10, (sk, sq)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("chunk_size", [None, 8, C])
def test_causal_and_chunked_attention_equal_the_blocked_implementation(heads,
                                                                      chunk_size) -> None:
    b, hq, hk = heads
    for sk in LENGTHS:
        for sq in sorted({sk, sk - 1, 1, 2, 7, 9} - {0}):
            if sq > sk:
                continue
            q, k, v = qkv(b, hq, hk, sq, sk, seed=sk * 100 + sq)
            ours = causal_attention(q, k, v, scale=SCALE, chunk_size=chunk_size)
            old = _old_causal(q, k, v, scale=SCALE, chunk_size=chunk_size)
            assert (ours - old).abs().max().item() <= 1e-10, (sk, sq)


@pytest.mark.parametrize("kind", ["dca", "chunked", "standard"])
def test_queries_in_a_static_buffer_see_only_earlier_keys(kind: str) -> None:
    """`positions` over a preallocated buffer whose later rows hold garbage (a static cache's
    keys) give the result of the exact key set."""
    cos, sin = tables()
    attend = {"dca": lambda q, k, v, **kw: _dca(q, k, v, cos, sin, **kw),
              "chunked": lambda q, k, v, **kw: causal_attention(q, k, v, scale=SCALE,
                                                                chunk_size=C, **kw),
              "standard": lambda q, k, v, **kw: causal_attention(q, k, v, scale=SCALE, **kw)}
    fn = attend[kind]
    for sk in LENGTHS:
        for sq in sorted({sk, 1, 3, L + 1} - {x for x in (3, L + 1) if x > sk}):
            q, k, v = qkv(2, 4, 2, sq, sk + 11, seed=sk)
            exact = fn(q, k[:, :, :sk], v[:, :, :sk])
            ours = fn(q, k, v, positions=torch.arange(sk - sq, sk))
            assert (ours - exact).abs().max().item() <= 1e-12, (sk, sq)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_the_lse_kernel_and_the_math_fallback_agree(causal: bool, heads) -> None:
    """The CPU flash kernel (float32, GQA inside or folded into rows) against the float64 math
    fallback: outputs and log-sum-exps."""
    hq, hk = heads
    q, k, v = qkv(2, hq, hk, 20, 20 if causal else 33)
    out, lse = _attend(q.float(), k.float(), v.float(), causal=causal, scale=SCALE)
    g = hq // hk
    ref, ref_lse = _math(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), causal, SCALE)
    assert out.dtype == torch.float32 and lse.shape == (2, hq, 20)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5
    out64, lse64 = _attend(q, k, v, causal=causal, scale=SCALE)  # float64: the math fallback
    assert (out64 - ref).abs().max().item() <= 1e-12
    assert (lse64 - ref_lse).abs().max().item() <= 1e-12


def test_merging_parts_by_lse_is_attention_over_their_union() -> None:
    q, k, v = qkv(1, 2, 2, 6, 30)
    cuts = [0, 7, 19, 30]
    parts = [(0, *_math(q, k[:, :, a:b], v[:, :, a:b], False, SCALE))
             for a, b in zip(cuts, cuts[1:])]
    whole, _ = _math(q, k, v, False, SCALE)
    assert (_merge(parts) - whole).abs().max().item() <= 1e-12


def test_float32_prefill_matches_float64() -> None:
    """The fused CPU kernels' path (float32) within float32 error of the float64 one."""
    cos, sin = tables(torch.float32)
    cos64, sin64 = tables()
    for sk, sq in [(64, 64), (64, 29), (37, 37), (40, 1)]:
        q, k, v = qkv(2, 4, 2, sq, sk)
        ours = _dca(q.float(), k.float(), v.float(), cos, sin)
        assert (ours.double() - _dca(q, k, v, cos64, sin64)).abs().max().item() <= 1e-5
        for chunk_size in (None, C):
            ours = causal_attention(q.float(), k.float(), v.float(), scale=SCALE,
                                    chunk_size=chunk_size)
            ref = causal_attention(q, k, v, scale=SCALE, chunk_size=chunk_size)
            assert (ours.double() - ref).abs().max().item() <= 1e-5


def test_the_decoding_step_is_one_graph() -> None:
    """With a static buffer and a position tensor, a decoding step traces without a graph
    break (no data-dependent Python control flow): torch.compile / CUDA graphs capture it."""
    torch._dynamo.reset()
    cos, sin = tables(torch.float32)
    q, k, v = qkv(2, 4, 2, 1, 48, dtype=torch.float32)

    def step(q, k, v, pos):
        return (_dca(q, k, v, cos, sin, positions=pos),
                causal_attention(q, k, v, scale=SCALE, chunk_size=C, positions=pos),
                causal_attention(q, k, v, scale=SCALE, positions=pos))

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    for p in (3, L - 1, L, L + 1, 2 * L + 5):
        pos = torch.tensor([p])
        exact = step(q, k[:, :, :p + 1], v[:, :, :p + 1], None)
        for ours, ref in zip(compiled(q, k, v, pos), exact):
            assert (ours - ref).abs().max().item() <= 1e-5, p
