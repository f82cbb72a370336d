"""Decode attention's Triton split-K kernels (models/attention/decode_kernels.py) against its
torch path (the CPU tests' subject) in bf16 on a 32K static cache of ragged lengths, eagerly and
replayed as a CUDA graph captured once and run at other lengths."""

from __future__ import annotations

import pytest
import torch

from models.attention import decode
from models.attention.decode import decode_attention, decode_attention_reference
from models.attention.rope import rope_cos_sin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

S_MAX = 32768
CHUNK, LOCAL = 8192, 1024  # DCA's L = 7168; the chunked kind's chunk 8192
# ragged, at chunk edges of both kinds (L, L + 1, 2L + 1; C, C + 1), the whole cache, one key
LENGTHS = [[1, 7169, 16385, 32768], [8192, 7168, 14337, 30001], [32768, 8193, 1, 14336]]
SHAPES = [(16, 4, 128), (9, 3, 64)]  # (hq, hk, d)
KINDS = ["standard", "chunked", "dca"]


def _inputs(hq: int, hk: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q = torch.randn(len(LENGTHS[0]), hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(len(LENGTHS[0]), hk, S_MAX, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    return q, k, v


def _settings(kind: str, d: int) -> dict[str, object]:
    cos, sin = rope_cos_sin(torch.arange(CHUNK + 1), d, theta=1e6, device="cuda")
    return {"scale": d ** -0.5, "kind": kind, "chunk_size": CHUNK, "local_size": LOCAL,
            "cos": cos, "sin": sin}


@pytest.mark.parametrize("hq, hk, d", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_the_torch_path(kind: str, hq: int, hk: int, d: int) -> None:
    q, k, v = _inputs(hq, hk, d)
    lengths = torch.tensor(LENGTHS[0], device="cuda", dtype=torch.int32)
    for i, n in enumerate(LENGTHS[0]):  # padding the kernels must never read
        k[i, :, n:] = v[i, :, n:] = float("nan")
    kw = _settings(kind, d)
    assert decode._use_triton(q, k, v)
    factors = [None]
    if kind == "dca":  # and with DCA's logit factors, per row and part
        factors.append(1 + torch.rand(len(LENGTHS[0]), 3, device="cuda"))
    for f in factors:
        kw["factors"] = f
        out = decode_attention(q, k, v, lengths, **kw)
        expected = decode_attention_reference(q, k, v, lengths, **kw)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        # the kernels round the probabilities to bf16 for their P @ V product
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("hq, hk, d", SHAPES[:1])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_a_captured_graph_replays_at_other_lengths(path: str, kind: str, hq: int, hk: int,
                                                   d: int) -> None:
    """Capture once at LENGTHS[0]; write new lengths (and a new query) in place, replay, and
    get the eager result at those lengths, bit for bit (the same kernels on the same inputs)."""
    fn = decode_attention if path == "triton" else decode_attention_reference
    q, k, v = _inputs(hq, hk, d, seed=1)
    lengths = torch.tensor(LENGTHS[0], device="cuda", dtype=torch.int32)
    kw = _settings(kind, d)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        fn(q, k, v, lengths, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, lengths, **kw)
    for seed, new in enumerate(LENGTHS[1:] + LENGTHS[:1]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(out, fn(q, k, v, lengths, **kw), rtol=0, atol=0)
