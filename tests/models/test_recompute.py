"""Activation recompute options: megatron's selective/full recompute, and full recompute that
keeps each core attention's (out, lse) instead of re-running it (models/recompute.py)."""

from __future__ import annotations

import pytest
import torch

import models.attention.causal as causal
import models.attention.dca.attention as dca
from models.gpt import build_gpt, transformer_config
from models.options import BuildOptions
from models.schema import AttentionConfig, ModelConfig
from tests.conftest import compose_config
from trainer.config import build_options

SEQ = 48
DCA = AttentionConfig(kind="dca", dca_chunk_size=16, dca_local_size=4)  # 4 chunks of L = 12


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the attention kernel forwards (the LSE path that keeping uses)."""
    calls = {"n": 0}
    real = dca.attention_forward

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dca, "attention_forward", counting)
    monkeypatch.setattr(causal, "attention_forward", counting)
    return calls


def gradients(attention: AttentionConfig, **recompute) -> tuple[dict[str, torch.Tensor], object]:
    config = transformer_config(ModelConfig(init_std=0.2), attention,
                                options=BuildOptions(**recompute))
    torch.manual_seed(0)
    gpt = build_gpt(config, 256, SEQ).train()
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    gpt(tokens, torch.arange(SEQ).expand_as(tokens), None).square().mean().backward()
    return {n: p.grad for n, p in gpt.named_parameters()}, gpt


@pytest.mark.parametrize("attention", [AttentionConfig(), DCA], ids=["standard", "dca"])
@pytest.mark.parametrize("recompute", [
    dict(recompute="full", recompute_keep_attention=True),
    dict(recompute="full", recompute_keep_attention=True, recompute_num_layers=1),
    dict(recompute="full", recompute_keep_attention=False),
    dict(recompute="selective", recompute_modules=["mlp"]),
    dict(recompute="selective", recompute_modules=["core_attn", "mlp"]),
], ids=["full-keep", "block1-keep", "full", "sel-mlp", "sel-attn-mlp"])
def test_recompute_gives_the_gradients_of_no_recompute(single_process, attention, recompute):
    reference, _ = gradients(attention)
    grads, gpt = gradients(attention, **recompute)
    assert grads.keys() == reference.keys()
    for name, grad in reference.items():
        # Kept standard attention runs the LSE kernels (math path on CPU) instead of SDPA.
        err = float((grads[name] - grad).norm() / grad.norm())
        assert err < 1e-5, (name, err)
    assert all(len(m.keeper) == 0 for m in gpt.modules() if hasattr(m, "keeper"))


@pytest.mark.parametrize("attention, per_layer", [(AttentionConfig(), 1), (DCA, 8)],
                         ids=["standard", "dca"])
def test_kept_attention_runs_its_kernels_once(single_process, kernel_calls, attention,
                                              per_layer) -> None:
    # DCA at 4 chunks: intra, successive and two inter calls per batch entry (2) and layer.
    layers = ModelConfig().num_layers
    gradients(attention, recompute="full", recompute_keep_attention=True)
    assert kernel_calls["n"] == layers * per_layer
    if attention.kind == "dca":  # without keeping, the recompute runs them all again
        kernel_calls["n"] = 0
        gradients(attention, recompute="full", recompute_keep_attention=False)
        assert kernel_calls["n"] == 2 * layers * per_layer


def test_a_recompute_outside_its_choices_is_refused_by_the_factory() -> None:
    """Hydra refuses it at composition (tests/trainer/test_entry_errors.py); the factory too, for
    options built in code."""
    cfg = compose_config([])
    with pytest.raises(ValueError, match="choose none, selective or full"):
        transformer_config(cfg.model, cfg.attention, options=BuildOptions(recompute="sometimes"))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.recompute_modules=[mlp]"], "needs trainer.recompute=selective"),
    (["trainer.recompute=selective", "trainer.recompute_modules=[layernorm]"], "not supported"),
    (["trainer.recompute_num_layers=2"], "needs trainer.recompute=full"),
    (["trainer.recompute=full", "trainer.recompute_num_layers=3"], r"must be in \[0, "),
])
def test_recompute_config_errors_are_clear(overrides: list[str], message: str) -> None:
    cfg = compose_config(overrides)
    t = cfg.trainer
    with pytest.raises(ValueError, match=message):
        transformer_config(cfg.model, cfg.attention,
                           options=build_options(t, bf16=False, on_gpu=False))


def test_keep_attention_needs_full_recompute() -> None:
    from models.config import LongContextConfig
    with pytest.raises(ValueError, match="full recompute only"):
        LongContextConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                          recompute_keep_attention=True)


@pytest.mark.slow  # end to end, seconds: CI runs it, the quick lane leaves it
def test_training_with_kept_attention_recompute(run_training) -> None:
    rows = run_training(["+attention=dca", "attention.dca_chunk_size=32",
                         "attention.dca_local_size=8", "trainer.recompute=full",
                         "trainer.max_steps=20", "trainer.save_interval=0"])
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
