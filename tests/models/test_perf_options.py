"""Throughput options that must not change the model: the fused RMSNorm's CPU fallback and
state dict, fused Adam's CUDA-only switch, and the benchmark's override merging."""

from __future__ import annotations

import pytest
import torch

from bench.train import matches, merge_overrides
from models.fused_rmsnorm import FusedRMSNorm
from models.gpt import build_gpt, transformer_config
from models.options import BuildOptions
from models.schema import AttentionConfig, ModelConfig
from trainer.optim import use_fused_adam


def test_fused_norm_model_has_the_same_state_and_outputs(single_process) -> None:
    plain = build_gpt(transformer_config(ModelConfig(), AttentionConfig()), 256, 64)
    fused = build_gpt(transformer_config(ModelConfig(), AttentionConfig(),
                                       options=BuildOptions(fused_norm=True)),
                      256, 64)
    layer = fused.decoder.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm)
    assert isinstance(layer.pre_mlp_layernorm, FusedRMSNorm)
    assert plain.state_dict().keys() == fused.state_dict().keys()
    fused.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand_as(tokens)
    torch.testing.assert_close(fused(tokens, positions, None), plain(tokens, positions, None))


def test_fused_norm_needs_rmsnorm() -> None:
    with pytest.raises(ValueError, match="fused_rmsnorm needs normalization RMSNorm"):
        from models.config import LongContextConfig
        LongContextConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                          normalization="LayerNorm", fused_rmsnorm=True)
    # transformer_config leaves LayerNorm models alone rather than failing.
    config = transformer_config(ModelConfig(normalization="LayerNorm"), AttentionConfig(),
                                options=BuildOptions(fused_norm=True))
    assert not config.fused_rmsnorm


def test_fused_adam_is_cuda_only() -> None:
    params = [torch.nn.Parameter(torch.randn(3))]

    class Wrapper:  # megatron's optimizers hold the torch one as `.optimizer`
        optimizer = torch.optim.AdamW(params)

    assert use_fused_adam(Wrapper()) == 0
    assert Wrapper.optimizer.param_groups[0]["fused"] in (None, False)


def test_bench_overrides_merge_by_key_and_match_cases() -> None:
    assert merge_overrides(["a=1", "b=2"], ["a=3"]) == ["a=3", "b=2"]
    case = {"model": "gpt_1p3b", "attention": "dca", "seq": 32768}
    assert matches("32768", case) and matches("dca:32768", case) and matches("gpt_1p3b", case)
    assert not matches("standard:32768", case) and not matches("131072", case)
    assert matches("keep:dca", {**case, "variant": "keep"}) and not matches("keep", case)
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        merge_overrides(["oops"])
