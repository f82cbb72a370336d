"""What `import-hf` reads from config.json, and what it refuses. The configs
come from transformers' own config classes (its defaults and serialisation, not ours)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from ckpt.hf_config import HFError, model_config

PATH = Path("hf/config.json")
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)


def _config(cls, **overrides) -> dict:
    cfg = cls(**SMALL, **overrides).to_dict()
    cfg["architectures"] = [cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


def test_llama3_rope_scaling_is_read() -> None:
    cfg = _config(LlamaConfig, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192))
    model = model_config(cfg, PATH)
    assert (model.num_layers, model.hidden_size, model.num_query_groups, model.kv_channels,
            model.ffn_hidden_size) == (2, 64, 2, 16, 96)
    assert (model.rope_scaling_type, model.rope_theta, model.rope_scaling_factor,
            model.rope_original_max_position, model.rope_high_freq_factor) == \
        ("llama3", 500000.0, 32.0, 8192, 4.0)


@pytest.mark.parametrize(("cls", "overrides", "named"), [
    (MistralConfig, dict(sliding_window=1024), "sliding_window=1024"),
    (Qwen2Config, dict(sliding_window=1024, use_sliding_window=True), "sliding_window=1024"),
    (LlamaConfig, dict(rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                            rope_theta=10000.0)), "'dynamic'"),
    (LlamaConfig, dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                            short_factor=[1.0] * 8, long_factor=[1.0] * 8)),
     "'longrope'"),
    (LlamaConfig, dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                            mscale=0.707)), "mscale"),
    (LlamaConfig, dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (LlamaConfig, dict(mlp_bias=True), "mlp_bias"),
])
def test_settings_that_change_the_function_are_refused(cls, overrides: dict, named: str) -> None:
    with pytest.raises(HFError, match=f"{PATH}.*{named}".replace("[", r"\[")):
        model_config(_config(cls, **overrides), PATH)


@pytest.mark.parametrize(("cls", "overrides"), [
    (MistralConfig, dict(sliding_window=4096)),       # covers the trained length
    (MistralConfig, dict(sliding_window=None)),
    (Qwen2Config, dict(use_sliding_window=False)),    # not in use
])
def test_windows_that_change_nothing_are_accepted(cls, overrides: dict) -> None:
    cfg = _config(cls, **overrides)
    if cls is Qwen2Config:  # as Qwen2's own config.json files: a window recorded, flag off
        cfg["sliding_window"] = 1024
    assert model_config(cfg, PATH).num_layers == 2


def test_unknown_architecture_is_refused() -> None:
    cfg = _config(LlamaConfig)
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    with pytest.raises(HFError, match="GPTNeoXForCausalLM.*not supported"):
        model_config(cfg, PATH)


@pytest.mark.parametrize("kind", ["none", "linear", "llama3", "yarn", "ntk"])
def test_exported_rope_is_ours_in_transformers_without_a_warning(kind: str) -> None:
    """export-hf's rope settings, read by transformers' own config and rotary embedding, give our
    frequencies and attention factor; only the keys transformers knows for the type are written
    (a llama3 export carried yarn's beta_fast/beta_slow and made transformers warn), and our
    static NTK base is written as plain RoPE at its larger theta."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from ckpt.hf_config import hf_config
    from models.gpt import rope_scaling
    from models.rope_scaling import rope_frequencies
    from models.schema import ModelConfig
    from tests.ckpt.test_hf_remote_code import no_warnings

    model = ModelConfig(hidden_size=64, num_attention_heads=4, kv_channels=16,
                        ffn_hidden_size=96, rope_theta=10000.0, rope_scaling_type=kind,
                        rope_scaling_factor=4.0, rope_original_max_position=1024)
    cfg = hf_config(model, 300, 4096, "float32", {})
    with no_warnings() as records:
        rotary = LlamaRotaryEmbedding(LlamaConfig.from_dict(cfg))
    assert not records, [r.getMessage() for r in records]
    inv_freq, factor = rope_frequencies(16, model.rope_theta, rope_scaling(model))
    assert rotary.inv_freq.tolist() == pytest.approx(inv_freq.tolist(), rel=1e-6)
    assert rotary.attention_scaling == pytest.approx(factor)
