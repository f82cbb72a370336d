"""models/rope_scaling.py against transformers' RoPE init functions (the oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.gpt import build_gpt, transformer_config
from models.rope_scaling import RopeScaling, rope_frequencies
from tests.conftest import compose_config

HEAD_DIM, THETA, ORIGINAL = 64, 500000.0, 256

CASES = {
    "linear": (dict(factor=4.0), RopeScaling("linear", 4.0)),
    "dynamic": (dict(factor=2.0), RopeScaling("dynamic", 2.0)),
    "ntk": (dict(factor=8.0), RopeScaling("ntk", 8.0)),  # the user-facing name of the same
    "llama3": (dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=ORIGINAL),
               RopeScaling("llama3", 8.0, ORIGINAL, low_freq_factor=1.0, high_freq_factor=4.0)),
    "yarn": (dict(factor=4.0, original_max_position_embeddings=ORIGINAL),
             RopeScaling("yarn", 4.0, ORIGINAL)),
    "yarn_betas": (dict(factor=16.0, original_max_position_embeddings=ORIGINAL, beta_fast=16.0,
                        beta_slow=2.0, attention_factor=1.3),
                   RopeScaling("yarn", 16.0, ORIGINAL, beta_fast=16.0, beta_slow=2.0,
                               attention_factor=1.3)),
}


def _hf(rope_type: str, params: dict) -> tuple[torch.Tensor, float]:
    rope_type = "dynamic" if rope_type == "ntk" else rope_type
    # transformers' dynamic base is theta * (s * n / L - (s - 1)) ** (d / (d - 2)) at length n;
    # at n = L (2s - 1) / s it is the static NTK base theta * s ** (d / (d - 2)) we compute.
    config = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                         max_position_embeddings=ORIGINAL,
                         rope_parameters=dict(rope_type=rope_type, rope_theta=THETA, **params))
    seq_len = None
    if rope_type == "dynamic":
        seq_len = int(ORIGINAL * (2 * params["factor"] - 1) / params["factor"])
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(name: str) -> None:
    params, ours = CASES[name]
    expected, expected_factor = _hf(ours.type, params)
    inv_freq, factor = rope_frequencies(HEAD_DIM, THETA, ours)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_none_is_plain_rope_and_float64_works() -> None:
    inv_freq, factor = rope_frequencies(HEAD_DIM, THETA, None, dtype=torch.float64)
    expected = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-15, atol=0)
    assert factor == 1.0


@pytest.mark.parametrize("bad, match", [
    (dict(type="longrope"), "unknown"),
    (dict(type="llama3", factor=8.0), "original_max_position"),
    (dict(type="linear", factor=0.0), "positive"),
])
def test_bad_settings_refused(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RopeScaling(**bad)


def logits(overrides: list[str], tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a tiny model with fixed random weights (peaked attention: init 0.2)."""
    cfg = compose_config(["model.init_std=0.2"] + overrides)
    torch.manual_seed(7)
    model = build_gpt(transformer_config(cfg.model, cfg.attention), 384, tokens.shape[1]).eval()
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


SCALED = {
    "llama3": ["model.rope_scaling_type=llama3", "model.rope_scaling_factor=8.0",
               "model.rope_original_max_position=16"],
    "yarn": ["model.rope_scaling_type=yarn", "model.rope_scaling_factor=4.0",
             "model.rope_original_max_position=16"],
}


@pytest.mark.parametrize("name", sorted(SCALED))
def test_dca_and_megatron_rope_apply_the_same_scaling(single_process, name: str) -> None:
    # Within one DCA chunk DCA is plain causal RoPE attention: its own rotation (DCA) and
    # megatron's rotary embedding (standard) must scale frequencies and logits alike.
    tokens = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(1))
    dca = ["+attention=dca", "attention.dca_chunk_size=64", "attention.dca_local_size=8"]
    standard = logits(SCALED[name], tokens)
    torch.testing.assert_close(logits(SCALED[name] + dca, tokens), standard, rtol=0,
                               atol=1e-5 * standard.abs().max().item())
    assert (logits([], tokens) - standard).abs().max() > 1e-3  # the scaling is in effect
