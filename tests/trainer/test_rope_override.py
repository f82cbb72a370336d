"""RoPE scaling chosen on the eval command line over a checkpoint's saved model
(trainer/rope_override.py) and the `+extrapolation=` presets."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from models.gpt import rope_scaling
from models.rope_scaling import rope_frequencies
from tests.conftest import compose_config
from trainer.errors import UserError
from trainer.rope_override import describe_rope, typed_model_keys, with_rope_overrides


def _saved(**changes: object):
    model = compose_config(["model=gpt_125m"]).model
    for k, v in changes.items():
        model[k] = v
    return model


def _resolve(overrides: list[str], saved, run_length: int = 8192):
    cfg = compose_config(overrides)
    return with_rope_overrides(cfg.model, saved, typed_model_keys(overrides), 2048, run_length)


@pytest.mark.parametrize("preset, kind", [("pi", "linear"), ("ntk", "ntk"), ("yarn", "yarn")])
def test_preset_applies_with_the_factor_of_the_run_length(preset: str, kind: str) -> None:
    model = _resolve([f"+extrapolation={preset}"], _saved())
    assert model.rope_scaling_type == kind and model.rope_scaling_factor == 8192 / 2048
    assert model.rope_original_max_position == 2048
    assert model.hidden_size == 768 and model.name == "gpt_125m"  # the rest is the checkpoint's
    rope_frequencies(64, model.rope_theta, rope_scaling(model))  # a valid scaling


def test_typed_factor_wins_over_the_preset_and_auto_factor_is_at_least_one() -> None:
    saved = _saved()
    assert _resolve(["+extrapolation=yarn", "model.rope_scaling_factor=16"],
                    saved).rope_scaling_factor == 16
    assert _resolve(["+extrapolation=pi"], saved, run_length=1024).rope_scaling_factor == 1


def test_typed_none_removes_the_saved_scaling_and_untyped_keeps_it() -> None:
    saved = _saved(rope_scaling_type="yarn", rope_scaling_factor=4.0,
                   rope_original_max_position=1024)
    assert _resolve(["model.rope_scaling_type=none"], saved).rope_scaling_type == "none"
    kept = _resolve([], saved)
    assert (kept.rope_scaling_type, kept.rope_scaling_factor) == ("yarn", 4.0)


def test_a_key_that_changes_parameters_is_refused_naming_it() -> None:
    with pytest.raises(UserError, match="model.hidden_size: run 256, checkpoint 768"):
        _resolve(["model.hidden_size=256"], _saved())
    assert _resolve(["model=gpt_125m", "+extrapolation=ntk"], _saved()).rope_scaling_type == "ntk"


def test_typed_model_keys_reads_every_override_form() -> None:
    assert typed_model_keys(["model.a=1", "+model.b=2", "++model.c=3", "model=gpt_125m",
                             "trainer.seq_length=8", "~model.d"]) == {"a", "b", "c"}


def test_label_names_method_and_factor() -> None:
    model = OmegaConf.merge(_saved(), {"rope_scaling_type": "yarn", "rope_scaling_factor": 8.0,
                                       "rope_original_max_position": 2048})
    assert describe_rope(model) == "yarn(s=8,T0=2048)"
    model.rope_scaling_type = "linear"
    assert describe_rope(model) == "pi(s=8)"
    assert describe_rope(_saved()) == ""
