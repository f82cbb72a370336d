"""Defaults that follow what was typed (trainer/defaults.py) — an lr floor below any
`trainer.lr`, a warm-up that fits a short run, DCA/chunked sizes that the default job's sequence
spans, and one line when a variant degenerates to plain causal attention."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import FAST, compose_config
from trainer.defaults import degenerate_attention, resolve_schedule
from trainer.errors import UserError
from trainer.train import Trainer
from trainer.validate import validate_train

UNSET = ["trainer.warmup_steps=null", "trainer.min_lr=null"]  # FAST sets a warm-up


def test_an_lr_below_the_old_floor_trains_to_a_tenth_of_it(run_training) -> None:
    # megatron asserted max_lr >= min_lr with the old fixed min_lr of 3e-4
    rows = run_training(UNSET + ["trainer.lr=2e-5", "trainer.max_steps=3",
                                 "trainer.save_interval=0"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["lr"] == pytest.approx(2e-6)


def test_min_lr_above_lr_is_one_line_naming_both(tmp_path: Path) -> None:
    cfg = compose_config(FAST + ["trainer.lr=1e-3", "trainer.min_lr=1e-2"])
    with pytest.raises(UserError) as info:
        Trainer(cfg, tmp_path)
    message = str(info.value)
    assert "trainer.min_lr (0.01)" in message and "trainer.lr (0.001)" in message
    assert "\n" not in message


def test_a_short_run_shortens_the_warm_up_and_says_so_once(run_training, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.defaults"):
        rows = run_training(UNSET + ["trainer.max_steps=5", "trainer.save_interval=0"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    notes = [r.message for r in caplog.records if "warm-up" in r.message]
    assert len(notes) == 1 and "2 steps" in notes[0], notes
    # 2 warm-up steps: lr rises to the peak at step 2, then decays
    assert rows[0]["lr"] < rows[1]["lr"] and rows[1]["lr"] > rows[2]["lr"]


def test_a_typed_warm_up_that_does_not_fit_is_still_refused() -> None:
    with pytest.raises(UserError, match=r"trainer.warmup_steps \(5\)"):
        validate_train(compose_config(FAST + ["trainer.max_steps=5", "trainer.warmup_steps=5"]))


def test_unset_values_are_filled_and_a_resume_keeps_the_saved_ones() -> None:
    cfg = compose_config(UNSET + ["trainer.max_steps=60"])
    resolve_schedule(cfg)
    assert (cfg.trainer.min_lr, cfg.trainer.warmup_steps) == (cfg.trainer.lr / 10, 5)
    saved = compose_config(["trainer.min_lr=1e-4", "trainer.warmup_steps=3"])
    resumed = compose_config(UNSET + ["trainer.max_steps=200"])
    resolve_schedule(resumed, saved)
    assert (resumed.trainer.min_lr, resumed.trainer.warmup_steps) == (1e-4, 3)
    new_lr = compose_config(UNSET + ["trainer.lr=1e-3"])  # with override_scheduler: its tenth
    resolve_schedule(new_lr, saved)
    assert new_lr.trainer.min_lr == pytest.approx(1e-4) and new_lr.trainer.min_lr <= 1e-3


def test_the_default_dca_job_spans_several_chunks() -> None:
    cfg = compose_config(["+attention=dca"])
    a, seq = cfg.attention, cfg.trainer.seq_length
    assert seq // (a.dca_chunk_size - a.dca_local_size) >= 3, (seq, a)
    assert degenerate_attention(a, seq) is None
    chunked = compose_config(["+attention=chunked"]).attention
    assert chunked.chunk_size < seq and degenerate_attention(chunked, seq) is None
    # a long run keeps the sources' sizes
    long = compose_config(["+attention=dca", "trainer.seq_length=32768"])
    assert (long.attention.dca_chunk_size, long.attention.dca_local_size) == (8192, 1024)


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_dca_trains_another_model_than_standard(run_training) -> None:
    common = ["trainer.max_steps=2", "trainer.save_interval=0"]
    standard = run_training(common, name="standard")
    dca = run_training(common + ["+attention=dca"], name="dca")
    # same initial weights (DCA adds no parameter): only the attention differs, from step 1
    assert all(s["loss"] != d["loss"] for s, d in zip(standard, dca, strict=True))


def test_a_degenerate_chunk_is_said_once(run_training, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        run_training(["+attention=dca", "attention.dca_chunk_size=8192",
                      "attention.dca_local_size=1024", "trainer.max_steps=1",
                      "trainer.warmup_steps=0", "trainer.save_interval=0"])
    notes = [r.message for r in caplog.records if "plain causal attention" in r.message]
    assert len(notes) == 1 and "dca_chunk_size" in notes[0] and "\n" not in notes[0]
