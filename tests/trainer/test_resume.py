"""Resuming with settings that differ from the checkpoint's: applied, refused or warned."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import compose_config
from trainer.resume import ResumeSettingsError, check_settings
from trainer.train import Trainer


@pytest.fixture
def saved_at_2(run_training, tmp_path: Path) -> Path:
    """A 4-step run (lr 3e-3) saved at step 2."""
    run_training(["trainer.max_steps=4", "trainer.save_interval=2", "checkpoint.save=true"],
                 name="short")
    return tmp_path / "short" / "checkpoints" / "iter_0000002"


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_a_longer_max_steps_extends_the_schedule(run_training, saved_at_2: Path) -> None:
    # The reference: an uninterrupted 8-step run's lr at steps 3..8.
    full = run_training(["trainer.max_steps=8", "checkpoint.save=false"], name="full")
    resumed = run_training(["trainer.max_steps=8", f"checkpoint.load={saved_at_2}"],
                           name="longer")
    assert [r["step"] for r in resumed] == list(range(3, 9))
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full[2:]]


def test_max_steps_below_the_checkpoint_step_is_refused(run_training, saved_at_2: Path) -> None:
    with pytest.raises(ResumeSettingsError,
                       match=r"trainer.max_steps=1 .*set trainer.max_steps >= 2"):
        run_training(["trainer.max_steps=1", "trainer.warmup_steps=0",  # warmup < max_steps
                      f"checkpoint.load={saved_at_2}"], name="shorter")


def test_a_new_lr_is_refused_without_the_switch(run_training, saved_at_2: Path) -> None:
    with pytest.raises(ResumeSettingsError,
                       match=r"trainer.lr 0.003 -> 0.01.*checkpoint.override_scheduler=true"):
        run_training(["trainer.max_steps=4", "trainer.lr=1e-2",
                      f"checkpoint.load={saved_at_2}"], name="refused")


def test_the_switch_applies_the_new_schedule(run_training, saved_at_2: Path) -> None:
    schedule = ["trainer.lr=1e-2", "trainer.min_lr=1e-3", "trainer.warmup_steps=2",
                "trainer.lr_decay_style=linear"]
    reference = run_training(["trainer.max_steps=4", "checkpoint.save=false", *schedule],
                             name="reference")
    resumed = run_training(["trainer.max_steps=4", *schedule, "checkpoint.override_scheduler=true",
                            f"checkpoint.load={saved_at_2}"], name="overridden")
    assert [r["lr"] for r in resumed] == [r["lr"] for r in reference[2:]]


def test_the_switch_applies_new_adam_betas(saved_at_2: Path, tmp_path: Path) -> None:
    cfg = compose_config(["logger=none", "trainer.seq_length=64", "trainer.micro_batch_size=4",
                          "trainer.global_batch_size=4", "trainer.warmup_steps=1",
                          "data.max_documents=60", "trainer.max_steps=4",
                          "trainer.adam_beta2=0.5", "checkpoint.override_scheduler=true",
                          f"checkpoint.load={saved_at_2}"])
    trainer = Trainer(cfg, tmp_path / "betas")
    try:
        assert {g["betas"] for g in trainer.optimizer.param_groups} == {(0.9, 0.5)}
    finally:
        trainer.close()


def test_data_and_attention_changes_warn_once_each(caplog: pytest.LogCaptureFixture) -> None:
    saved = compose_config([])
    cfg = compose_config(["trainer.seq_length=128", "trainer.global_batch_size=16",
                          "data.valid_fraction=0.1", "+attention=dca", "trainer.max_steps=70"])
    with caplog.at_level(logging.WARNING):
        warnings = check_settings(saved, cfg, 60, "ckpt")
    changed = sorted(w.split()[3].split("=")[0] for w in warnings)
    assert changed == ["attention.dca_chunk_size", "attention.dca_local_size", "attention.kind",
                       "data.valid_fraction", "trainer.global_batch_size", "trainer.seq_length"]


def test_another_tokenizer_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}")
    b.write_text('{"other": 1}')
    with pytest.raises(ResumeSettingsError, match="data.tokenizer"):
        check_settings(compose_config([]), compose_config(["data.tokenizer=" + str(a)]), 1, "c")
    with pytest.raises(ResumeSettingsError, match=f"set data.tokenizer={a}"):
        check_settings(compose_config([f"data.tokenizer={a}"]),
                       compose_config([f"data.tokenizer={b}"]), 1, "c")
    moved = tmp_path / "moved.json"
    moved.write_text(a.read_text())
    assert check_settings(compose_config([f"data.tokenizer={a}"]),
                          compose_config([f"data.tokenizer={moved}"]), 1, "c") == []
