"""The tests' `compose_config` (tests/composition.py: Hydra's defaults stage cached per group
selection, the value overrides applied as Hydra applies them) composes what Hydra composes in
full, fails where it fails, and hands out configs no other test shares."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.composition import compose_config, compose_in_full
from tests.conftest import FAST

SETTINGS = [
    [],
    FAST + ["trainer.max_steps=2", "checkpoint.dir=/tmp/x/checkpoints"],
    ["+attention=dca", "attention.dca_chunk_size=64", "model=gpt_125m", "parallel.tp=2"],
    # a value override before the group it sets a key of, and one key set twice (the last wins)
    ["attention.dca_chunk_size=32", "+attention=dca", "trainer.lr=1", "trainer.lr=2"],
    ["+experiment=passkey", "trainer.seq_length=128", "logger=none", "eval.lengths=[128,256]"],
    ["+extrapolation=yarn", "+trainer.max_stepz=3", "logger.group=g", "data.path=null"],
    ["+attention=head_gate", "logger=wandb", "logger.tags=[a,b]", "model=llama3_8b"],
]


@pytest.mark.parametrize("overrides", SETTINGS, ids=range(len(SETTINGS)))
def test_the_same_config_as_hydra_in_full(overrides: list[str]) -> None:
    cached, full = compose_config(overrides), compose_in_full(overrides)
    assert OmegaConf.to_yaml(cached) == OmegaConf.to_yaml(full)
    assert OmegaConf.to_yaml(cached, resolve=True) == OmegaConf.to_yaml(full, resolve=True)
    assert OmegaConf.is_struct(cached) and OmegaConf.is_struct(full)
    assert OmegaConf.get_type(cached.trainer) is OmegaConf.get_type(full.trainer)


@pytest.mark.parametrize("overrides", [
    ["trainer.max_stepz=3"],                    # not in the schema: needs `+`
    ["trainer.max_steps=many"],                 # wrong type
    ["attention=dca"],                          # a group not in the defaults: needs `+`
    ["model=gpt_9000"],                         # no such config
    ["trainer.seq_length=64", "trainer.attention_kernel=fast"],  # outside a choice
])
def test_the_same_refusals_as_hydra_in_full(overrides: list[str]) -> None:
    errors = []
    for compose in (compose_config, compose_in_full):
        with pytest.raises(ConfigCompositionException) as info:
            compose(overrides)
        errors.append((str(info.value), type(info.value.__cause__), str(info.value.__cause__)))
    assert errors[0] == errors[1]


def test_each_call_gets_its_own_config() -> None:
    first = compose_config(["+attention=dca"])
    first.attention.dca_chunk_size = 3
    first.trainer.max_steps = 3
    again = compose_config(["+attention=dca"])
    assert again.attention.dca_chunk_size != 3 and again.trainer.max_steps != 3
