"""Fine-tuning from an imported (model-only) checkpoint: the saved model config, step 0, resume,
a head gate added at fine-tune time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.load import load_model_weights
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from models.gpt import build_model
from models.schema import AttentionConfig
from parallel.distributed import unwrap_model
from tests.ckpt import hf_models
from tests.conftest import FAST, compose_config

hf_imported = hf_models.hf_imported  # the shared fixture


@pytest.mark.slow  # end to end, seconds: CI runs it, the quick lane leaves it
def test_imported_model_fine_tunes_and_resumes(tmp_path: Path, run_training, hf_imported) -> None:
    _, imported = hf_imported("llama", False)
    # No model=: the checkpoint's config is used; byte tokens (257) fit its 384 rows.
    first = run_training([f"checkpoint.load={imported}", "trainer.max_steps=2",
                          "trainer.save_interval=2"], name="ft")
    assert [r["step"] for r in first] == [1, 2]  # a fresh start, not step 0 + resume
    resumed = run_training([f"checkpoint.load={tmp_path / 'ft' / 'checkpoints'}",
                            "trainer.max_steps=3", "trainer.save_interval=0"], name="resume")
    assert [r["step"] for r in resumed] == [3]


@pytest.mark.parametrize("family, attention", [("llama", "head_gate"),
                                               ("qwen2", "[dca,head_gate]")])
def test_a_head_gate_is_added_to_an_imported_model(tmp_path: Path, hf_imported, family: str,
                                                   attention: str) -> None:
    """The gate's rows start at the model's init (nothing else is invented); every other weight
    is the imported one; the gated model trains."""
    from trainer.train import Trainer

    _, imported = hf_imported(family, family == "qwen2")
    cfg = compose_config(FAST + [f"+attention={attention}", f"checkpoint.load={imported}",
                                 "trainer.max_steps=2", "checkpoint.save=false"]
                         + (["attention.dca_chunk_size=32", "attention.dca_local_size=8"]
                            if "dca" in attention else []))
    trainer = Trainer(cfg, tmp_path)
    try:
        gated = dict(unwrap_model(trainer.model[0]).named_parameters())  # one pipeline chunk
        plain = build_model(cfg.model, AttentionConfig(), cfg.parallel,
                            vocab_size=trainer.vocab_size, max_sequence_length=64).gpt
        load_model_weights(resolve_checkpoint(imported), plain)
        heads = cfg.model.num_attention_heads
        for name, ref in plain.named_parameters():
            got = gated[name].detach()
            if "linear_qkv" in name:
                got, gate = got[:-heads], got[-heads:]
                if name.endswith("bias"):  # Qwen2: the documented 2.0
                    assert torch.equal(gate, torch.full_like(gate, 2.0)), name
                else:  # 0.1 x the normal init: small, not the imported rows, not zero
                    std = gate.std().item()
                    assert 0.5 < std / (0.1 * cfg.model.init_std) < 1.5, (name, std)
            assert torch.equal(got, ref.detach()), name
        assert [row["step"] for row in [trainer.run()]] == [2]
    finally:
        trainer.close()


def test_the_optimizer_is_built_from_the_imported_weights(tmp_path: Path, hf_imported,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 megatron's optimizer steps fp32 main copies of the weights, taken when it is
    built, and writes them back after each step: a fine-tune must build it after the imported
    weights are in the model (built before, one step made the model its random init again and
    the loss jumped to ln(vocabulary) at step 2 on the GPU). megatron's bf16 optimizer needs
    CUDA tensors, so on the CPU this checks the order: the weights the optimizer sees."""
    import trainer.train as train_module

    _, imported = hf_imported("llama", False)
    cfg = compose_config(FAST + [f"checkpoint.load={imported}", "trainer.max_steps=2",
                                 "checkpoint.save=false"])
    seen: dict[str, torch.Tensor] = {}
    build = train_module.build_optimizer

    def recording(cfg, model, bf16):  # noqa: ANN001, ANN202
        seen.update({name: p.detach().clone()
                     for name, p in unwrap_model(model[0]).named_parameters()})
        return build(cfg, model, bf16)

    monkeypatch.setattr(train_module, "build_optimizer", recording)
    trainer = train_module.Trainer(cfg, tmp_path)
    try:
        plain = build_model(cfg.model, AttentionConfig(), cfg.parallel,
                            vocab_size=trainer.vocab_size, max_sequence_length=64).gpt
        load_model_weights(resolve_checkpoint(imported), plain)
    finally:
        trainer.close()
    for name, ref in plain.named_parameters():
        assert torch.equal(seen[name], ref.detach()), name


def test_a_different_chosen_model_is_refused(hf_imported) -> None:
    from trainer.init_from import adopt_saved_model, open_load

    _, imported = hf_imported("qwen2", True)
    cfg = compose_config(FAST + [f"checkpoint.load={imported}", "model=gpt_125m"])
    with pytest.raises(ValueError, match="model.num_layers: run 12, checkpoint 2"):
        adopt_saved_model(cfg, open_load(cfg.checkpoint.load))
    cfg = compose_config(FAST + [f"checkpoint.load={imported}"])
    assert adopt_saved_model(cfg, open_load(cfg.checkpoint.load)) is not None
    assert cfg.model.qkv_bias


def test_a_fine_tune_takes_the_command_lines_rope_scaling(hf_imported) -> None:
    from trainer.init_from import adopt_saved_model, open_load

    _, imported = hf_imported("llama", False)
    saved = Checkpoint(resolve_checkpoint(str(imported))).meta
    cfg = compose_config(FAST + [f"checkpoint.load={imported}",
                                 "+extrapolation=yarn", "model.rope_scaling_factor=4"])
    assert adopt_saved_model(cfg, open_load(cfg.checkpoint.load)) is not None
    assert (cfg.model.rope_scaling_type, cfg.model.rope_scaling_factor) == ("yarn", 4)
    # 0 in the preset: the saved value, else the trained length
    assert cfg.model.rope_original_max_position == (saved.model.rope_original_max_position
                                                    or saved.seq_length)
    assert cfg.model.num_layers == saved.model.num_layers
