"""RoPE scaling chosen at eval (and fine-tune) time on top of a checkpoint's saved model.

A checkpoint fixes the model's shape, but the `model.rope_*` settings change no parameter, so a
training-free extrapolation method (PI, NTK-aware, YaRN: `+extrapolation=pi|ntk|yarn`) can be
applied to any checkpoint. The rule: every `model.rope_*` key the command line sets (typed, or
set by a preset: any value other than the default composition's) replaces the saved one; every
other model key the command line sets must equal the saved one, else the run is refused.

Two values are resolved against the run: `rope_scaling_factor=0` (the presets' value) means the
run's length over the trained length, at least 1 (eval: the longest `eval.lengths`; fine-tune:
`trainer.seq_length`), and `rope_original_max_position=0` means the trained length.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from models.schema import ModelConfig
from trainer.config import CONF_DIR
from trainer.errors import UserError


def default_model() -> DictConfig:
    """The model group as the entry points compose it when none is chosen."""
    # by location: `import conf` would import a `conf` package of the working directory
    tiny = OmegaConf.load(Path(CONF_DIR) / "model" / "tiny.yaml")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), tiny)


def typed_model_keys(overrides: list[str]) -> set[str]:
    """`model.<key>` names set on the command line (`model.k=v`, `+model.k=v`, `++model.k=v`)."""
    keys = set()
    for item in overrides:
        name = item.split("=", 1)[0].lstrip("+~")
        if name.startswith("model.") and "=" in item:
            keys.add(name.split(".", 1)[1])
    return keys


def with_rope_overrides(run_model: DictConfig, saved_model: DictConfig, typed: set[str],
                        trained_length: int, run_length: int) -> DictConfig:
    """The saved model with the run's RoPE choices applied (see the module docstring)."""
    default = default_model()
    saved = OmegaConf.merge(OmegaConf.structured(ModelConfig), saved_model)
    chosen = [k for k in run_model if k != "name"
              and (k in typed or run_model.get(k) != default.get(k))]
    other = [f"model.{k}: run {run_model[k]}, checkpoint {saved.get(k)}" for k in chosen
             if not k.startswith("rope_") and run_model[k] != saved.get(k)]
    if other:
        raise UserError("these settings change the checkpoint's parameters and cannot be "
                        "overridden (only model.rope_* can); drop them:\n  " + "\n  ".join(other))
    model = saved.copy()
    for k in chosen:
        if k.startswith("rope_"):
            model[k] = run_model[k]
    if model.rope_scaling_type != "none":
        if model.rope_scaling_factor == 0:
            model.rope_scaling_factor = max(1.0, run_length / trained_length)
        if model.rope_original_max_position == 0:
            model.rope_original_max_position = trained_length
    return model


def describe_rope(model: DictConfig) -> str:
    """A run label's RoPE part: '' without scaling, else e.g. 'yarn(s=8,T0=2048)'."""
    kind = model.get("rope_scaling_type", "none")
    if kind == "none":
        return ""
    name = {"linear": "pi"}.get(kind, kind)
    parts = [f"s={model.rope_scaling_factor:g}"]
    if kind in ("yarn", "llama3"):
        parts.append(f"T0={model.rope_original_max_position}")
    if kind == "yarn" and (model.rope_beta_fast, model.rope_beta_slow) != (32.0, 1.0):
        parts.append(f"beta={model.rope_beta_fast:g}/{model.rope_beta_slow:g}")
    if kind == "yarn" and model.rope_attention_factor is not None:
        parts.append(f"mscale={model.rope_attention_factor:g}")
    return f"{name}({','.join(parts)})"
