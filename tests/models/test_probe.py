"""The attention probe (models/attention/probe.py): its probabilities are the kernels' own
(p @ v reproduces each variant's output rows, float64), its summaries are right on a case done
by hand, and a model records every layer under `probing`."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.causal import causal_attention
from models.attention.chunked import chunked_attention
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.scaling import DCAScaling
from models.attention.probe import (
    active_probe,
    causal_probabilities,
    chunked_probabilities,
    dca_probabilities,
    probing,
    record,
)
from models.gpt import build_gpt, transformer_config
from models.options import BuildOptions
from models.schema import AttentionConfig, ModelConfig

ROWS = torch.tensor([0, 5, 17, 30, 47])


def qkv(seq: int = 48, hq: int = 4, hk: int = 2, d: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seq, h, d, dtype=torch.float64, generator=g) for h in (hq, hk, hk)]


def through(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[b, hq, n, s] @ v [b, s, hk, d] -> [b, n, hq, d]."""
    v = v.repeat_interleave(probs.shape[1] // v.shape[2], dim=2)
    return torch.einsum("bhns,bshd->bnhd", probs, v)


def test_causal_and_chunked_probabilities_are_the_kernels() -> None:
    q, k, v = qkv()
    scale = 0.3
    out = causal_attention(q, k, v, softmax_scale=scale)
    torch.testing.assert_close(through(causal_probabilities(q, k, ROWS, scale), v), out[:, ROWS])
    out = chunked_attention(q, k, v, chunk_size=10, softmax_scale=scale)
    torch.testing.assert_close(through(chunked_probabilities(q, k, ROWS, scale, 10), v),
                               out[:, ROWS])


@pytest.mark.parametrize("scaling", [DCAScaling(), DCAScaling(kind="log", floor_scale=8),
                                     DCAScaling(kind="yarn", parts="inter")])
def test_dca_probabilities_are_the_kernels(scaling: DCAScaling) -> None:
    q, k, v = qkv()  # C = 12, w = 3: chunks of 9, every part present
    args = dict(chunk_size=12, local_size=3, rope_theta=500.0, mscale=1.2)
    out = dual_chunk_attention(q, k, v, softmax_scale=0.3, scaling=scaling, **args)
    probs = dca_probabilities(q, k, ROWS, 0.3, scaling=scaling, rope_scaling=None, **args)
    torch.testing.assert_close(through(probs, v), out[:, ROWS])


def test_summary_of_uniform_attention_by_hand() -> None:
    """Zero queries attend uniformly to their i + 1 keys: entropy ln(i + 1); row i puts
    (number of keys at a distance in the bucket) / (i + 1) in each bucket."""
    rows = torch.tensor([3, 9])
    q, k, _ = qkv(seq=10)
    probs = causal_probabilities(torch.zeros_like(q), k, rows, 1.0)
    with probing(rows, [0, 2, 8]) as probe:
        record(1, probs, rows)
    summary = probe.layers[1]
    assert summary.entropy == pytest.approx((math.log(4) + math.log(10)) / 2)
    # row 3: distances 0..3 -> [2, 2, 0] of 4; row 9: 0..9 -> [2, 6, 2] of 10
    expected = [(2 / 4 + 2 / 10) / 2, (2 / 4 + 6 / 10) / 2, (0 + 2 / 10) / 2]
    assert summary.mass == pytest.approx(expected)


def probe_a_model(attention: AttentionConfig, device: str = "cpu") -> None:
    """Build a two-layer model on `device`, probe two rows of a 96-token forward: every layer
    records a summary, the probe ends with its block, and an unprobed forward still runs."""
    config = transformer_config(ModelConfig(), attention,
                                options=BuildOptions(on_gpu=device == "cuda"))
    model = build_gpt(config, 256, 128).to(device).eval()
    tokens = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(0))
    tokens, positions = tokens.to(device), torch.arange(96, device=device)[None]
    with torch.no_grad(), probing(torch.tensor([10, 95]), [0, 32, 64]) as probe:
        model(tokens, positions, None)
    assert sorted(probe.layers) == [1, 2]
    for summary in probe.layers.values():
        assert 0 < summary.entropy <= math.log(96)
        assert sum(summary.mass) == pytest.approx(1.0)
    assert active_probe() is None  # the probe ends with its block
    with torch.no_grad():
        model(tokens, positions, None)  # no probe: the layers compute as before


@pytest.mark.parametrize("attention", [
    AttentionConfig(), AttentionConfig(kind="dca", dca_chunk_size=32, dca_local_size=8),
    AttentionConfig(kind="chunked", chunk_size=16, global_layer_interval=2)])
def test_a_model_records_every_layer_while_probing(single_process,
                                                   attention: AttentionConfig) -> None:
    probe_a_model(attention)
