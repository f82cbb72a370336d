"""Decode attention (models/attention/decode.py): the torch path against the plain-torch model
export's attention (ckpt/remote_code/longctx_attention.py) sequence by sequence, on a static cache
of ragged lengths whose padding holds NaN; and the Triton split-K kernels against the torch path
under Triton's CPU interpreter (skipped unless TRITON_INTERPRET=1 and triton imports)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ckpt.remote_code.longctx_attention import causal_attention, dca_attention
from models.attention.decode import _triton_decode, decode_attention, decode_attention_reference
from models.attention.rope import rope_cos_sin

SCALE = 0.3
HEADS = [(6, 2), (4, 4)]  # GQA (three query heads a K/V head) and MHA


def _cache(lengths: list[int], s_max: int, hq: int, hk: int, d: int, dtype: torch.dtype,
           seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [b, hq, d], k, v [b, hk, s_max, d] (random) and lengths [b]."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    q = torch.randn(b, hq, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(b, hk, s_max, d, generator=gen, dtype=torch.float64).to(dtype)
            for _ in range(2))
    return q, k, v, torch.tensor(lengths)


def _poisoned(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
              chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with NaN at every position >= length (and, given `chunk_size`, before the query's
    chunk): keys that must never reach the output, not even with a zero weight."""
    k, v = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        k[i, :, n:] = v[i, :, n:] = float("nan")
        if chunk_size is not None:
            start = (n - 1) // chunk_size * chunk_size
            k[i, :, :start] = v[i, :, :start] = float("nan")
    return k, v


def _tables(chunk_size: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(torch.arange(chunk_size + 1), d, theta=500.0)  # float32 [C + 1, d]


def _expected(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
              **kw: object) -> torch.Tensor:
    """The export's attention of each sequence's last query over exactly its valid keys."""
    rows = []
    for i, n in enumerate(lengths.tolist()):
        qi, ki, vi = q[i:i + 1, :, None], k[i:i + 1, :, :n], v[i:i + 1, :, :n]
        if kind == "dca":
            rows.append(dca_attention(qi, ki, vi, scale=SCALE, **kw))
        else:
            rows.append(causal_attention(qi, ki, vi, scale=SCALE, **kw))
    return torch.cat(rows)[:, :, 0]  # [b, hq, d]


def _dca_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                chunk_size: int, local_size: int, cos: torch.Tensor,
                sin: torch.Tensor, factors: torch.Tensor | None = None) -> torch.Tensor:
    """DCA in float64 from the SPEC's table, key by key (each key picks the query's RoPE row by
    its chunk relation, and its logit factor from `factors` [b, 3] by the same relation): a
    formulation independent of the export's and of the torch path's."""
    span, hk = chunk_size - local_size, k.shape[1]
    rows = []
    for i, n in enumerate(lengths.tolist()):
        pos, j = n - 1, torch.arange(n)
        r = pos % span
        relation = (pos // span - j // span).clamp(max=2)  # [n] 0 own, 1 previous, 2 older
        row = torch.where(relation == 0, r,
                          torch.where(relation == 1, min(r + span, chunk_size),
                                      min(2 * span - 1, chunk_size)))  # [n]
        c, s = cos.double()[row], sin.double()[row]  # [n, d]
        x = q[i].unflatten(0, (hk, -1))[:, :, None]  # [hk, g, 1, d]
        x_rot = x * c + torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]],
                                  dim=-1) * s  # [hk, g, n, d]: the query as each key sees it
        scores = torch.einsum("hgnd,hnd->hgn", x_rot, k[i, :, :n]) * SCALE
        if factors is not None:
            scores = scores * factors[i].double()[relation]
        out = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), v[i, :, :n])
        rows.append(out.flatten(0, 1))  # [hq, d]
    return torch.stack(rows)


@pytest.mark.parametrize("hq, hk", HEADS)
def test_standard_matches_the_export(hq: int, hk: int) -> None:
    q, k, v, lengths = _cache([1, 2, 17, 64, 100, 128], 128, hq, hk, 32, torch.float64)
    out = decode_attention(q, *_poisoned(k, v, lengths), lengths, scale=SCALE, kind="standard")
    torch.testing.assert_close(out, _expected("standard", q, k, v, lengths), rtol=0, atol=1e-10)


@pytest.mark.parametrize("hq, hk", HEADS)
def test_chunked_matches_the_export_at_chunk_edges(hq: int, hk: int) -> None:
    c = 16  # lengths at a multiple of the chunk, one past it and one short of it
    q, k, v, lengths = _cache([1, 15, 16, 17, 31, 32, 33, 47, 128], 128, hq, hk, 32,
                              torch.float64)
    out = decode_attention(q, *_poisoned(k, v, lengths, c), lengths, scale=SCALE,
                           kind="chunked", chunk_size=c)
    expected = _expected("chunked", q, k, v, lengths, chunk_size=c)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("hq, hk", HEADS)
@pytest.mark.parametrize("local_size", [2, 8, 20])  # L = 22, 16, 4: few to many chunks
def test_dca_matches_the_export_at_chunk_boundaries(hq: int, hk: int, local_size: int) -> None:
    c, d = 24, 32
    span = c - local_size
    lengths = [1, span - 1, span, span + 1, 2 * span, 2 * span + 1, 3 * span + 2, 200, 256]
    q, k, v, lens = _cache(lengths, 256, hq, hk, d, torch.float64)
    cos, sin = _tables(c, d)
    kw = {"chunk_size": c, "local_size": local_size, "cos": cos, "sin": sin}
    out = decode_attention(q, *_poisoned(k, v, lens), lens, scale=SCALE, kind="dca", **kw)
    torch.testing.assert_close(out, _dca_oracle(q, k, v, lens, c, local_size, cos, sin),
                               rtol=0, atol=1e-10)
    # the export's DCA has rounded its scores and softmax to float32 (float64 inputs too): the
    # float64 check is the oracle's above
    torch.testing.assert_close(out, _expected("dca", q, k, v, lens, **kw), rtol=0, atol=1e-6)


def _factors(b: int, seed: int = 5) -> torch.Tensor:
    """[b, 3] logit factors, a different one per row and part (1 among them)."""
    f = 1 + torch.rand(b, 3, generator=torch.Generator().manual_seed(seed))
    f[0] = 1.0
    return f


@pytest.mark.parametrize("hq, hk", HEADS)
def test_dca_logit_factors_scale_each_part(hq: int, hk: int) -> None:
    """Per-row, per-part logit factors (DCA's length scaling) against the oracle, and against
    the export's DCA given the same factors as [3, 1] per query."""
    c, local, d = 24, 8, 32
    span = c - local
    lens = [1, span, span + 1, 2 * span + 1, 3 * span + 2, 100]
    q, k, v, lengths = _cache(lens, 128, hq, hk, d, torch.float64, seed=4)
    cos, sin = _tables(c, d)
    kw = {"chunk_size": c, "local_size": local, "cos": cos, "sin": sin}
    factors = _factors(len(lens))
    out = decode_attention(q, *_poisoned(k, v, lengths), lengths, scale=SCALE, kind="dca",
                           factors=factors, **kw)
    torch.testing.assert_close(out, _dca_oracle(q, k, v, lengths, c, local, cos, sin, factors),
                               rtol=0, atol=1e-10)
    export = torch.cat([dca_attention(q[i:i + 1, :, None], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                                      scale=SCALE, factors=factors[i, :, None], **kw)
                        for i, n in enumerate(lens)])[:, :, 0]
    torch.testing.assert_close(out, export, rtol=0, atol=1e-6)
    plain = decode_attention(q, k, v, lengths, scale=SCALE, kind="dca", **kw)
    assert (out[1:] - plain[1:]).abs().max() > 1e-3  # the factors matter where they are not 1
    torch.testing.assert_close(out[0], plain[0], rtol=0, atol=1e-12)


def test_dca_within_one_chunk_is_causal_rope_attention() -> None:
    """S <= L: DCA is ordinary causal attention with q rotated to its own position."""
    c, local, d = 64, 16, 32
    q, k, v, lengths = _cache([1, 5, 47, 48], 48, 6, 2, d, torch.float64, seed=3)
    cos, sin = _tables(c, d)
    out = decode_attention(q, k, v, lengths, scale=SCALE, kind="dca", chunk_size=c,
                           local_size=local, cos=cos, sin=sin)
    pos = lengths - 1
    c_q, s_q = cos.double()[pos][:, None], sin.double()[pos][:, None]  # [b, 1, d]
    q_rot = q * c_q + torch.cat([-q[..., d // 2:], q[..., :d // 2]], dim=-1) * s_q
    expected = decode_attention(q_rot, k, v, lengths, scale=SCALE, kind="standard")
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["standard", "chunked", "dca"])
def test_low_precision_follows_float64(kind: str) -> None:
    """bf16 and float32 inputs: the result in the input's dtype, close to the float64 one."""
    c, d = 16, 32
    cos, sin = _tables(c, d)
    kw = {"chunk_size": c, "local_size": 4, "cos": cos, "sin": sin}
    q, k, v, lengths = _cache([3, 40, 64], 64, 6, 2, d, torch.float64, seed=1)
    exact = decode_attention(q, k, v, lengths, scale=SCALE, kind=kind, **kw)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), lengths, scale=SCALE,
                               kind=kind, **kw)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)


def test_bad_arguments_are_refused() -> None:
    q, k, v, lengths = _cache([4], 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="kind"):
        decode_attention(q, k, v, lengths, scale=SCALE, kind="local")
    with pytest.raises(ValueError, match="chunk_size"):
        decode_attention(q, k, v, lengths, scale=SCALE, kind="chunked")
    with pytest.raises(ValueError, match="cos"):
        decode_attention(q, k, v, lengths, scale=SCALE, kind="dca", chunk_size=8, local_size=2)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, k, v, lengths.float(), scale=SCALE, kind="standard")
    with pytest.raises(ValueError, match="heads"):
        decode_attention(q[:, :3], k, v, lengths, scale=SCALE, kind="standard")
    with pytest.raises(ValueError, match="factors"):
        decode_attention(q, k, v, lengths, scale=SCALE, kind="standard", factors=_factors(1))
    cos, sin = _tables(8, 16)
    with pytest.raises(ValueError, match="factors"):
        decode_attention(q, k, v, lengths, scale=SCALE, kind="dca", chunk_size=8, local_size=2,
                         cos=cos, sin=sin, factors=_factors(2))


_INTERPRETED = (os.environ.get("TRITON_INTERPRET") == "1"
                and importlib.util.find_spec("triton") is not None)


@pytest.mark.skipif(not _INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["standard", "chunked", "dca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d", [(6, 2, 32), (2, 2, 64)])  # GQA, MHA
def test_triton_kernels_match_the_torch_path(kind: str, dtype: torch.dtype, hq: int, hk: int,
                                             d: int) -> None:
    """Split counts from one range to more ranges than blocks (so ranges lie wholly beyond
    short lengths), partial blocks, ragged lengths, NaN padding, int32 and strided int64
    lengths."""
    c, local, s_max = 24, 8, 200  # L = 16; 200 keys: the last block of a range is partial
    cos, sin = _tables(c, d)
    kw = {"kind": kind, "chunk_size": c, "local_size": local, "cos": cos, "sin": sin}
    q, k, v, lengths = _cache([1, 16, 17, 24, 33, 200], s_max, hq, hk, d, dtype)
    k, v = _poisoned(k, v, lengths, c if kind == "chunked" else None)
    if kind == "dca":  # with DCA's logit factors too
        kw["factors"] = _factors(len(lengths))
    expected = decode_attention_reference(q, k, v, lengths, scale=SCALE, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the kernel rounds P to bf16
    strided = torch.stack([lengths, lengths], dim=1)[:, 0]  # a view with stride 2
    for num_splits, lens in ((1, lengths.int()), (3, strided), (16, lengths.int())):
        out = _triton_decode(q, k, v, lens, scale=SCALE, num_splits=num_splits, block_n=16,
                             **kw)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
