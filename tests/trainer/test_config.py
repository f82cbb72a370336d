"""Config composition: defaults, the model registry, the `+attention` rule, typed errors."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from models.gpt import padded_vocab_size, transformer_config
from models.schema import ParallelConfig
from tests.conftest import compose_config
from trainer.config import check_known_keys

MODELS = ["tiny", "gpt_125m", "gpt_350m", "gpt_1p3b", "llama3_8b"]


def test_default_config_is_the_tiny_cpu_run() -> None:
    cfg = compose_config()
    assert cfg.model.name == "tiny"
    assert cfg.attention.kind == "standard"
    assert cfg.data.name == "embedded"
    assert cfg.parallel.tp == 1
    assert cfg.logger.wandb and cfg.logger.mode == "offline"


@pytest.mark.parametrize("name", MODELS)
def test_every_registered_model_builds_a_valid_megatron_config(name: str) -> None:
    cfg = compose_config([f"model={name}"])
    mc = transformer_config(cfg.model, cfg.attention)
    assert mc.num_layers == cfg.model.num_layers
    assert mc.hidden_size == cfg.model.hidden_size


def test_model_sizes_are_what_their_names_say() -> None:
    def params(name: str) -> float:
        m = compose_config([f"model={name}"]).model
        mc = transformer_config(m, compose_config().attention)
        h, kv = mc.hidden_size, mc.kv_channels * mc.num_query_groups
        per_layer = h * (h + 2 * kv) + h * h + 3 * h * mc.ffn_hidden_size
        return (mc.num_layers * per_layer + 50_000 * h) / 1e9

    assert 0.10 < params("gpt_125m") < 0.16
    assert 0.30 < params("gpt_350m") < 0.42
    assert 1.1 < params("gpt_1p3b") < 1.5
    assert 7.0 < params("llama3_8b") < 8.5


@pytest.mark.parametrize("name", ["dca", "chunked", "standard"])
def test_attention_group_needs_plus_because_it_is_not_in_defaults(name: str) -> None:
    with pytest.raises(ConfigCompositionException, match=rf"\+attention={name}"):
        compose_config([f"attention={name}"])
    assert compose_config([f"+attention={name}"]).attention.kind == name


def test_misspelt_key_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["trainer.max_stepz=3"])
    assert "Key 'max_stepz' not in 'TrainerConfig'" in str(err.value.__cause__)


def test_appended_unknown_key_is_rejected_before_training() -> None:
    cfg = compose_config(["+trainer.max_stepz=3"])  # `+` appends on purpose in Hydra
    with pytest.raises(ValueError, match=r"unknown config keys: trainer\.max_stepz"):
        check_known_keys(cfg)
    check_known_keys(compose_config())


def test_wrong_type_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["trainer.max_steps=many"])
    assert isinstance(err.value.__cause__, ValidationError)


def test_heads_must_divide_by_tp_with_a_clear_message() -> None:
    cfg = compose_config(["model=gpt_125m"])  # 12 heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(12\) must be a multiple of "
                       r"tensor_model_parallel_size \(8\)"):
        transformer_config(cfg.model, cfg.attention, ParallelConfig(tp=8))


def test_vocab_padding_is_independent_of_tp() -> None:
    assert padded_vocab_size(257, 128, 1) == padded_vocab_size(257, 128, 2) == 384
    with pytest.raises(ValueError, match="must divide by tp"):
        padded_vocab_size(257, 128, 256)


def test_every_choice_is_declared_once_and_agrees_with_its_users() -> None:
    """Each choice is a StrEnum declared once (models/schema.py for the model's,
    models/options.py and trainer/config.py for the run's), naming what the code that takes it
    accepts (the lists the kernels, DCA and the placement check keep)."""
    from models.attention import kernels
    from models.attention.dca import plan
    from models.options import AttentionKernel, DCABackward
    from parallel import placement
    from trainer.config import Device, Precision

    assert tuple(AttentionKernel) == kernels.KERNELS
    assert tuple(DCABackward) == plan.BACKWARDS
    assert (tuple(Device), tuple(Precision)) == (placement.DEVICES, placement.PRECISIONS)


def test_the_run_settings_are_the_runs_and_choices_stay_strings() -> None:
    """The kernel and DCA's backward path and kept rotations are the `trainer` group's (and
    BuildOptions'), not AttentionConfig's, what the model is; a choice's member equals its
    string and is written as it (JSON, YAML, the run config)."""
    import dataclasses
    import json

    from omegaconf import OmegaConf

    from ckpt.saved_config import unresolved_env
    from models.options import MOVED_FROM_ATTENTION, BuildOptions
    from models.schema import AttentionConfig, AttentionKind
    from trainer.config import MOVED, TrainerConfig, build_options

    attention = {f.name for f in dataclasses.fields(AttentionConfig)}
    trainer = {f.name for f in dataclasses.fields(TrainerConfig)}
    options = {f.name for f in dataclasses.fields(BuildOptions)}
    assert not set(MOVED_FROM_ATTENTION) & attention
    assert set(MOVED_FROM_ATTENTION.values()) <= trainer & options
    assert MOVED == {"attention.kernel": "trainer.attention_kernel",
                     "attention.dca_backward": "trainer.dca_backward",
                     "attention.dca_keep_rotated": "trainer.dca_keep_rotated"}
    cfg = compose_config(["+attention=dca", "trainer.attention_kernel=cudnn",
                          "trainer.dca_backward=parts", "trainer.dca_keep_rotated=true"])
    assert cfg.attention.kind == "dca" and cfg.attention.kind is AttentionKind.dca
    built = build_options(cfg.trainer, bf16=False, on_gpu=False)
    assert (built.attention_kernel, built.dca_backward, built.dca_keep_rotated) == (
        "cudnn", "parts", True)
    written = unresolved_env(cfg)
    assert type(written["attention"]["kind"]) is str and written["trainer"]["dca_backward"] == \
        "parts"
    assert json.loads(json.dumps(dataclasses.asdict(AttentionConfig(kind=AttentionKind.dca))))[
        "kind"] == "dca"
    assert "kind: dca" in OmegaConf.to_yaml(cfg.attention)


def test_a_value_outside_a_choice_fails_composition() -> None:
    """Checked by Hydra when it composes (trainer.entry.check_overrides makes it one line:
    tests/trainer/test_entry_errors.py)."""
    for override in ("trainer.attention_kernel=fast", "attention.kind=ring",
                     "trainer.lr_decay_style=step", "eval.template=fancy"):
        with pytest.raises(ConfigCompositionException) as info:
            compose_config([override])
        assert isinstance(info.value.__cause__, ValidationError)
