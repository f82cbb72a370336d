"""Resuming with settings that differ from the checkpoint's: applied, refused or warned."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import FAST, compose_config
from trainer.errors import UserError
from trainer.init_from import open_load
from trainer.resume import ResumeSettingsError, check_resume, check_settings
from trainer.train import Trainer, train


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run (lr 3e-3) saved at steps 2 and 4, trained once for the tests below: they
    only read it (each resume writes into its own run directory)."""
    run_dir = tmp_path_factory.mktemp("short")
    train(compose_config(FAST + [f"checkpoint.dir={run_dir / 'checkpoints'}",
                                 "trainer.max_steps=4", "trainer.save_interval=2",
                                 "checkpoint.save=true"]), run_dir)
    return run_dir / "checkpoints" / "iter_0000002"


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_a_longer_max_steps_extends_the_schedule(run_training, saved_at_2: Path) -> None:
    # The reference: an uninterrupted 8-step run's lr at steps 3..8.
    full = run_training(["trainer.max_steps=8", "checkpoint.save=false"], name="full")
    resumed = run_training(["trainer.max_steps=8", f"checkpoint.load={saved_at_2}"],
                           name="longer")
    assert [r["step"] for r in resumed] == list(range(3, 9))
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full[2:]]


def test_max_steps_below_the_checkpoint_step_is_refused(saved_at_2: Path) -> None:
    cfg = compose_config(FAST + ["trainer.max_steps=1", "trainer.warmup_steps=0",  # < max_steps
                                 f"checkpoint.load={saved_at_2}"])
    with pytest.raises(ResumeSettingsError,
                       match=r"trainer.max_steps=1 .*set trainer.max_steps >= 2"):
        check_resume(cfg, open_load(cfg.checkpoint.load))


def test_a_new_lr_is_refused_without_the_switch(run_training, saved_at_2: Path) -> None:
    # Through a run: the Trainer refuses before it reads the data or builds the model.
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


def test_resuming_a_finished_run_says_it_is_finished(run_training, saved_at_2: Path) -> None:
    finished = saved_at_2.parent / "iter_0000004"
    with pytest.raises(UserError, match=r"at step 4 and trainer.max_steps is 4: that run is "
                                         r"finished\. .*trainer.max_steps=8"):
        run_training(["trainer.max_steps=4", f"checkpoint.load={finished}"], name="again")
