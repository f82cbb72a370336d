"""Hostile settings of `python -m trainer` and `trainer.eval`.

Each one used to train or evaluate silently wrong (a negative grad_clip turned clipping off,
`data.max_documents=0` trained on one document, `eval.passkey_trials=-1` reported
`0.00 (-0.0)`), or failed late (`eval.depths=[2.0]` after the model ran) or with the wrong
message (`eval.perplexity_windows=0`). Now each is one `UserError` line naming the key, before
the data or the model exists; a NaN model's evaluation reports it instead of crashing in
matplotlib. The next attacker of these settings starts here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import FAST, compose_config
from trainer.errors import UserError
from trainer.train import Trainer


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("reached past the up-front checks")


@pytest.mark.parametrize(("override", "key"), [
    ("trainer.lr=-0.01", "trainer.lr=-0.01"),
    ("trainer.lr=nan", "trainer.lr=nan"),
    ("trainer.adam_beta1=1.5", "trainer.adam_beta1=1.5"),
    ("trainer.adam_beta2=-0.1", "trainer.adam_beta2=-0.1"),
    ("trainer.weight_decay=-1", "trainer.weight_decay=-1"),
    ("trainer.grad_clip=-1", "trainer.grad_clip=-1"),
    ("data.max_documents=0", "data.max_documents=0"),
    ("data.max_documents=-5", "data.max_documents=-5"),
    ("model.layernorm_epsilon=nan", "model.layernorm_epsilon=nan"),
    ("model.layernorm_epsilon=-1e-5", "model.layernorm_epsilon=-1e-05"),
])
def test_bad_training_setting_is_refused_before_data_and_model(
        override: str, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_config(FAST + [override])
    monkeypatch.setattr(Trainer, "_setup_parallel", _must_not_run)
    monkeypatch.setattr(Trainer, "_setup_model", _must_not_run)
    with pytest.raises(UserError) as info:
        Trainer(cfg, tmp_path)
    assert key in str(info.value) and "\n" not in str(info.value), info.value


@pytest.mark.parametrize("override", ["trainer.grad_clip=0", "trainer.weight_decay=0",
                                      "trainer.adam_beta1=0", "data.max_documents=1"])
def test_the_edges_of_each_range_are_accepted(override: str) -> None:
    from trainer.validate import validate_train

    validate_train(compose_config(FAST + [override]))


@pytest.mark.parametrize(("override", "key"), [
    ("eval.batch_size=0", "eval.batch_size=0"),
    ("eval.passkey_digits=-3", "eval.passkey_digits=-3"),
    ("eval.passkey_digits=0", "eval.passkey_digits=0"),
    ("eval.passkey_trials=-1", "eval.passkey_trials=-1"),
    ("eval.trained_length=-5", "eval.trained_length=-5"),
    ("data.max_documents=0", "data.max_documents=0"),
    ("eval.depths=[2.0]", "eval.depths=[2.0]"),
    ("eval.depths=[]", "eval.depths=[]"),
    ("eval.multikey_keys=0", "eval.multikey_keys=0"),
    ("eval.perplexity_windows=0", "eval.perplexity_windows=0"),
])
def test_bad_eval_setting_is_refused_before_the_model_runs(
        two_step_checkpoints: Path, override: str, key: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import eval as eval_entry

    cfg = compose_config(["logger=none", "eval.lengths=[64]",
                          f"checkpoint.load={two_step_checkpoints}", override])
    monkeypatch.setattr(eval_entry, "load_model", _must_not_run)
    with pytest.raises(UserError) as info:
        eval_entry.evaluate(cfg, tmp_path)
    assert key in str(info.value) and "\n" not in str(info.value), info.value


def test_a_nan_model_is_reported_not_a_matplotlib_crash(tmp_path: Path, caplog) -> None:
    """Perplexity NaN at every length (a diverged model) used to end in matplotlib's 'Data
    cannot be log-scaled' after eval.json was written."""
    from trainer import eval as eval_entry
    from trainer.evals.measures import PasskeyCell, PerplexityPoint

    cells = [PasskeyCell(64, 0.0, 0, 2), PasskeyCell(128, 0.0, 0, 2)]
    points = [PerplexityPoint(64, float("nan"), 2), PerplexityPoint(128, 1000.0, 1)]
    assert points[1].perplexity == float("inf")  # e^1000 overflowed: OverflowError
    plots = eval_entry._plots(tmp_path, "standard", cells, points)
    assert plots["perplexity"].stat().st_size > 0
    with caplog.at_level(logging.WARNING):
        eval_entry._warn_non_finite(points)
    assert "perplexity is not finite at lengths [64, 128]" in caplog.text
