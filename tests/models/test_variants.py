"""Attention variants inside megatron's GPTModel: specs, RoPE handling, validation, TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.attention.chunked_module import ChunkedCoreAttention
from models.attention.core import CausalCoreAttention
from models.attention.dca.module import DCACoreAttention
from models.gpt import build_gpt, transformer_config
from models.options import BuildOptions
from tests.conftest import FAST, compose_config, train_on_ranks
from trainer.config import build_options

SEQ = 48


def logits(overrides: list[str], tokens: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """Logits of a tiny model; the same seed gives the same weights for every variant."""
    # A larger init than training's 0.02 gives peaked attention, so variants visibly differ.
    cfg = compose_config(["model.init_std=0.2"] + overrides)
    torch.manual_seed(seed)
    model = build_gpt(transformer_config(cfg.model, cfg.attention), 384, SEQ).eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_dca_within_one_chunk_is_the_standard_rope_model(single_process, tokens) -> None:
    # S <= L = chunk - local: DCA is plain causal RoPE attention, so DCA's own RoPE must match
    # megatron's (rotate-half, theta) and megatron's RoPE must be skipped exactly once.
    standard = logits([], tokens)
    dca = logits(["+attention=dca", "attention.dca_chunk_size=64", "attention.dca_local_size=8"],
                 tokens)
    # fp32 noise between SDPA and DCA's own kernels: ~1e-6 of the logit scale.
    torch.testing.assert_close(dca, standard, rtol=0, atol=1e-5 * standard.abs().max().item())
    # Past one chunk the positions are remapped and the outputs must differ.
    multi = logits(["+attention=dca", "attention.dca_chunk_size=16", "attention.dca_local_size=4"],
                   tokens)
    assert (multi - standard).abs().max() > 1e-2


def test_chunked_with_one_chunk_is_the_standard_model(single_process, tokens) -> None:
    standard = logits([], tokens)
    one_chunk = logits(["+attention=chunked", "attention.chunk_size=64",
                        "attention.global_layer_interval=0"], tokens)
    torch.testing.assert_close(one_chunk, standard, rtol=1e-5, atol=1e-5)
    chunks = logits(["+attention=chunked", "attention.chunk_size=16",
                     "attention.global_layer_interval=0"], tokens)
    assert (chunks - standard).abs().max() > 1e-2
    # The first chunk's tokens see the same context either way.
    torch.testing.assert_close(chunks[:, :16], standard[:, :16], rtol=1e-5, atol=1e-5)


def test_chunked_interleaves_global_layers_without_rope(single_process) -> None:
    cfg = compose_config(["+attention=chunked", "model.num_layers=4",
                          "attention.global_layer_interval=2"])
    config = transformer_config(cfg.model, cfg.attention)
    assert config.no_rope_freq == [0, 1, 0, 1]
    model = build_gpt(config, 384, SEQ)
    cores = [type(layer.self_attention.core_attention) for layer in model.decoder.layers]
    assert cores == [ChunkedCoreAttention, CausalCoreAttention] * 2


def test_dca_layers_skip_megatron_rope(single_process) -> None:
    """... and take how they run (DCA's backward path, kept rotations: run settings) from the
    run's options."""
    cfg = compose_config(["+attention=dca", "trainer.dca_backward=one_piece",
                          "trainer.dca_keep_rotated=true"])
    config = transformer_config(cfg.model, cfg.attention,
                                options=build_options(cfg.trainer, bf16=False, on_gpu=False))
    assert config.no_rope_freq == [1] * cfg.model.num_layers
    model = build_gpt(config, 384, SEQ)
    assert all(isinstance(layer.self_attention.core_attention, DCACoreAttention)
               and layer.self_attention.core_attention.backward == "one_piece"
               and layer.self_attention.core_attention.keep_rotated
               for layer in model.decoder.layers)


@pytest.mark.parametrize("overrides, message", [
    (["attention.dca_chunk_size=64", "attention.dca_local_size=64"],
     r"dca_chunk_size \(64\) must exceed dca_local_size \(64\)"),
    (["attention.dca_local_size=0"], "must be positive"),
])
def test_dca_config_errors_are_early_and_clear(overrides, message) -> None:
    cfg = compose_config(["+attention=dca"] + overrides)
    with pytest.raises(ValueError, match=message):
        transformer_config(cfg.model, cfg.attention)


def test_a_dca_backward_outside_its_choices_is_refused_by_the_factory() -> None:
    """Hydra refuses it at composition (tests/trainer/test_entry_errors.py); the factory too, for
    options built in code."""
    cfg = compose_config(["+attention=dca"])
    with pytest.raises(ValueError, match="dca_backward must be one of auto, one_piece, parts, "
                                         "got 'fast'"):
        transformer_config(cfg.model, cfg.attention, options=BuildOptions(dca_backward="fast"))


def test_chunked_config_errors_are_early_and_clear() -> None:
    cfg = compose_config(["+attention=chunked", "attention.chunk_size=0"])
    with pytest.raises(ValueError, match=r"chunk_size \(0\) must be positive"):
        transformer_config(cfg.model, cfg.attention)


@pytest.mark.parametrize("variant", ["dca", "chunked"])
def test_variant_trains(run_training, variant: str) -> None:
    rows = run_training([f"+attention={variant}", "trainer.max_steps=20",
                         "checkpoint.save=false", "attention.dca_chunk_size=40",
                         "attention.dca_local_size=8", "attention.chunk_size=16",
                         "attention.global_layer_interval=2"])
    assert sum(r["loss"] for r in rows[-3:]) / 3 < 0.8 * rows[0]["loss"]


@pytest.mark.slow
def test_dca_at_tp2_matches_tp1(tmp_path: Path) -> None:
    args = FAST + ["+attention=dca", "attention.dca_chunk_size=40", "attention.dca_local_size=8",
                   "trainer.max_steps=4", "checkpoint.save=false"]
    tp1 = train_on_ranks(args, tmp_path / "tp1")
    tp2 = train_on_ranks(args + ["parallel.tp=2"], tmp_path / "tp2", nproc=2)
    for a, b in zip(tp1, tp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-4)
