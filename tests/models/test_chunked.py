"""Chunked (Llama 4) attention against the dense masked float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.attention.chunked import chunked_attention
from tests.reference import causal_mask, dense_attention, document_ids, positions_in_document


def chunked_mask(seq_len: int, chunk_size: int, cu_seqlens: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """[S, S] bool: query i sees key j iff j <= i, same document, same chunk of its document."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, seq_len])
    doc, pos = document_ids(cu_seqlens), positions_in_document(cu_seqlens)
    chunk = pos // chunk_size
    same = (doc[:, None] == doc[None, :]) & (chunk[:, None] == chunk[None, :])
    return same & causal_mask(seq_len)


def make_qkv(b: int, s: int, hq: int, hk: int, d: int = 8, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype)
               for h in (hq, hk, hk))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def check_against_reference(fn, b, s, hq, hk, chunk_size, cu_seqlens=None, scale=None):
    """Compare output and dq, dk, dv of fn(q, k, v) with the float64 dense masked reference."""
    q, k, v = make_qkv(b, s, hq, hk)
    allowed = chunked_mask(s, chunk_size, cu_seqlens)
    ref = dense_attention(q, k, v, allowed, softmax_scale=scale)
    out = fn(q, k, v)
    assert out.shape == ref.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for name, g, rg in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("b,s,hq,hk,chunk_size", [
    (1, 16, 2, 2, 4),   # S multiple of C
    (1, 18, 2, 2, 4),   # S not a multiple of C (tail of 2)
    (1, 5, 2, 2, 8),    # S < C: plain causal
    (1, 8, 2, 2, 8),    # S == C
    (1, 19, 4, 2, 5),   # GQA with tail
    (1, 12, 4, 1, 4),   # MQA
    (3, 14, 4, 2, 4),   # batch > 1 with tail (non-viewable fold)
    (2, 12, 2, 2, 3),   # batch > 1 aligned
])
def test_contiguous_matches_reference(b, s, hq, hk, chunk_size):
    check_against_reference(lambda q, k, v: chunked_attention(q, k, v, chunk_size=chunk_size),
                            b, s, hq, hk, chunk_size)


def test_softmax_scale():
    check_against_reference(
        lambda q, k, v: chunked_attention(q, k, v, chunk_size=4, softmax_scale=0.3),
        1, 10, 2, 2, 4, scale=0.3)


@pytest.mark.parametrize("bounds,hq,hk", [
    # lengths 3 (< C), 10 (2 chunks + 2), 1, 13 (3 chunks + 1), 8 (exactly 2 chunks)
    ([0, 3, 13, 14, 27, 35], 2, 2),
    ([0, 3, 13, 14, 27, 35], 4, 2),
    # empty document (repeated boundary, as in padded cu_seqlens) and one document only
    ([0, 6, 6, 17], 2, 1),
    ([0, 11], 2, 2),
])
def test_packed_matches_reference(bounds, hq, hk):
    cu = torch.tensor(bounds)
    check_against_reference(
        lambda q, k, v: chunked_attention(q, k, v, chunk_size=4, cu_seqlens=cu),
        1, bounds[-1], hq, hk, 4, cu_seqlens=cu)


def test_packed_accepts_int_list():
    q, k, v = make_qkv(1, 9, 2, 2)
    torch.testing.assert_close(chunked_attention(q, k, v, chunk_size=4, cu_seqlens=[0, 5, 9]),
                               chunked_attention(q, k, v, chunk_size=4,
                                                 cu_seqlens=torch.tensor([0, 5, 9])))


def strided_sbhd_chunking(q, k, v, chunk_size):
    """The public-draft bug on [s, b, h, d]: x.reshape(C, -1, h, d) groups strided tokens."""
    s, b, h, d = q.shape
    def group(x):  # [C, s/C*b, h, d] -> [s/C*b, h, C, d]; entry j holds tokens j, j+s/C, ...
        return x.reshape(chunk_size, -1, *x.shape[2:]).permute(1, 2, 0, 3)
    out = F.scaled_dot_product_attention(group(q), group(k), group(v), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, h, -1)


def correct_sbhd_chunking(q, k, v, chunk_size):
    """view(s/C, C, b, h, d), then move the chunk axis into the batch."""
    s, b, h, d = q.shape
    def group(x):  # [s/C*b, h, C, d], contiguous chunks
        return x.view(s // chunk_size, chunk_size, b, *x.shape[2:]).permute(0, 2, 3, 1, 4) \
                .reshape(-1, x.shape[2], chunk_size, x.shape[3])
    out = F.scaled_dot_product_attention(group(q), group(k), group(v), is_causal=True)
    out = out.view(s // chunk_size, b, h, chunk_size, -1).permute(0, 3, 1, 2, 4)
    return out.reshape(s, b, h, -1)


def sbhd(fn):
    """Adapt an [s, b, h, d] implementation to the reference's [b, s, h, d] layout."""
    return lambda q, k, v: fn(*(x.transpose(0, 1) for x in (q, k, v))).transpose(0, 1)


def test_sbhd_strided_grouping_trap_is_caught():
    b, s, h, chunk_size = 2, 16, 2, 4
    # The same check that validates ours rejects the strided grouping ...
    with pytest.raises(AssertionError):
        check_against_reference(sbhd(lambda q, k, v: strided_sbhd_chunking(q, k, v, chunk_size)),
                                b, s, h, h, chunk_size)
    # ... while the correct sbhd grouping and chunked_attention (fed sbhd data) pass it.
    check_against_reference(sbhd(lambda q, k, v: correct_sbhd_chunking(q, k, v, chunk_size)),
                            b, s, h, h, chunk_size)
    check_against_reference(
        sbhd(lambda q, k, v: chunked_attention(*(x.transpose(0, 1) for x in (q, k, v)),
                                               chunk_size=chunk_size).transpose(0, 1)),
        b, s, h, h, chunk_size)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("cu", [None, [0, 7, 30, 40]])
def test_low_precision_sanity(dtype, tol, cu):
    s, chunk_size = 40, 16
    q, k, v = make_qkv(1, s, 4, 2, d=16, dtype=dtype, seed=1)
    cu_t = None if cu is None else torch.tensor(cu)
    out = chunked_attention(q, k, v, chunk_size=chunk_size, cu_seqlens=cu_t)
    assert out.dtype == dtype
    ref = dense_attention(q, k, v, chunked_mask(s, chunk_size, cu_t))
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    out.float().square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("s,cu,expected_calls", [
    (16, None, 1),               # aligned: one batched call
    (18, None, 2),               # full chunks + tail
    (3, None, 1),                # S < C
    (35, [0, 3, 13, 14, 27, 35], 4),  # lengths {4, 3, 2, 1}: one call per distinct length
])
def test_fast_path_calls_without_masks(monkeypatch, s, cu, expected_calls):
    calls = []
    real_sdpa = F.scaled_dot_product_attention
    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape, attn_mask, kwargs.get("is_causal")))
        assert k.shape[1] == 2  # K/V never repeated for GQA
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = make_qkv(1, s, 4, 2)
    chunked_attention(q, k, v, chunk_size=4, cu_seqlens=cu)
    assert len(calls) == expected_calls
    assert all(mask is None and causal for _, mask, causal in calls)
    assert all(shape[2] <= 4 for shape, _, _ in calls)  # never more than C tokens per entry


@pytest.mark.parametrize("kwargs,shapes,match", [
    (dict(chunk_size=0), None, "chunk_size must be a positive int"),
    (dict(chunk_size=-4), None, "chunk_size must be a positive int"),
    (dict(chunk_size=4.0), None, "chunk_size must be a positive int"),
    (dict(chunk_size=True), None, "chunk_size must be a positive int"),
    (dict(chunk_size=4), ((1, 8, 3, 8), (1, 8, 2, 8), (1, 8, 2, 8)), "not divisible"),
    (dict(chunk_size=4), ((1, 8, 2, 8), (1, 7, 2, 8), (1, 7, 2, 8)), "share batch and seq"),
    (dict(chunk_size=4), ((1, 8, 2, 8), (1, 8, 2, 4), (1, 8, 2, 8)), "head dims differ"),
    (dict(chunk_size=4), ((8, 2, 8), (8, 2, 8), (8, 2, 8)), r"\[batch, seq, heads, dim\]"),
    (dict(chunk_size=4), ((1, 0, 2, 8),) * 3, "seq > 0"),
    (dict(chunk_size=4, cu_seqlens=[0, 8]), ((2, 8, 2, 8),) * 3, "requires batch 1"),
    (dict(chunk_size=4, cu_seqlens=[0, 5]), None, "end at seq=8"),
    (dict(chunk_size=4, cu_seqlens=[1, 8]), None, "start at 0"),
    (dict(chunk_size=4, cu_seqlens=[0, 6, 3, 8]), None, "non-decreasing"),
])
def test_errors(kwargs, shapes, match):
    shapes = shapes or ((1, 8, 2, 8),) * 3
    q, k, v = (torch.randn(*shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        chunked_attention(q, k, v, **kwargs)
