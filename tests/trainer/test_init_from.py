"""Fine-tuning from an imported (model-only) checkpoint: the saved model config, step 0, resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt.hf_import import import_hf
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from tests.ckpt.hf_models import save_hf
from tests.conftest import FAST, compose_config


def test_imported_model_fine_tunes_and_resumes(tmp_path: Path, run_training) -> None:
    hf = save_hf(tmp_path / "hf", "llama", tied=False)
    import_hf(hf, tmp_path / "imported", 1)
    # No model=: the checkpoint's config is used; byte tokens (257) fit its 384 rows.
    first = run_training([f"checkpoint.load={tmp_path / 'imported'}", "trainer.max_steps=2",
                          "trainer.save_interval=2"], name="ft")
    assert [r["step"] for r in first] == [1, 2]  # a fresh start, not step 0 + resume
    resumed = run_training([f"checkpoint.load={tmp_path / 'ft' / 'checkpoints'}",
                            "trainer.max_steps=3", "trainer.save_interval=0"], name="resume")
    assert [r["step"] for r in resumed] == [3]


def test_a_different_chosen_model_is_refused(tmp_path: Path) -> None:
    from trainer.init_from import adopt_saved_model

    hf = save_hf(tmp_path / "hf", "qwen2", tied=True)
    import_hf(hf, tmp_path / "imported", 1, dry_run=False)
    cfg = compose_config(FAST + [f"checkpoint.load={tmp_path / 'imported'}", "model=gpt_125m"])
    with pytest.raises(ValueError, match="model.num_layers: run 12, checkpoint 2"):
        adopt_saved_model(cfg)
    cfg = compose_config(FAST + [f"checkpoint.load={tmp_path / 'imported'}"])
    assert adopt_saved_model(cfg) is not None and cfg.model.qkv_bias


def test_a_fine_tune_takes_the_command_lines_rope_scaling(tmp_path: Path) -> None:
    from trainer.init_from import adopt_saved_model

    hf = save_hf(tmp_path / "hf", "llama", tied=False)
    import_hf(hf, tmp_path / "imported", 1)
    saved = Checkpoint(resolve_checkpoint(str(tmp_path / "imported"))).config
    cfg = compose_config(FAST + [f"checkpoint.load={tmp_path / 'imported'}",
                                 "+extrapolation=yarn", "model.rope_scaling_factor=4"])
    assert adopt_saved_model(cfg) is not None
    assert (cfg.model.rope_scaling_type, cfg.model.rope_scaling_factor) == ("yarn", 4)
    # 0 in the preset: the saved value, else the trained length
    assert cfg.model.rope_original_max_position == (saved.model.rope_original_max_position
                                                    or saved.trainer.seq_length)
    assert cfg.model.num_layers == saved.model.num_layers
