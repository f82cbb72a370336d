"""The one check of a model's settings (`ModelConfig`, `AttentionConfig`), wherever they come from:
the Hydra config (`trainer/validate.py`), a checkpoint's record (`ckpt.meta.CheckpointMeta.
from_saved`, also inside a zarr export's manifest) and a Hugging Face config.json
(`ckpt/hf_config.py`).

Every value is checked for its type (a whole number is an int, not a bool, a float or a string;
a flag is a bool, not the string "false") and its range, then the few relations between them
that every model needs (query groups dividing the heads, an even head dimension, DCA's local
window inside its chunk), before anything is built, so that a value out of range ends neither in
a traceback far from its cause nor in a hang (a billion layers). The limits are far above any model
trained today and far below what hangs or exhausts a machine. A problem raises `SettingError`,
one line naming the setting as its source spells it, the value and the valid range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any

from models.schema import (
    AttentionConfig,
    AttentionKind,
    DCAScaledParts,
    DCAScalingKind,
    ModelConfig,
)

MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17  # 131072
MAX_HEADS = 1024
MAX_HEAD_DIM = 2048
MAX_FFN = 1 << 20
MAX_VOCAB = 1 << 24  # 16.7M tokens; the largest vocabularies in use hold about 256K
MAX_DIVISOR = 1 << 16  # make_vocab_size_divisible_by
MAX_LENGTH = 1 << 30  # tokens: sequence lengths, positions, chunk sizes
MAX_NAME = 1000  # characters of a model's name

Name = Callable[[str], str]
# A rule returns None for a good value, else what the value must be ("a whole number in ...").
Rule = Callable[[Any], str | None]


class SettingError(ValueError):
    """A model or attention setting of the wrong type or out of range (the message names it)."""


def whole(low: int, high: int, *, optional: bool = False) -> Rule:
    """An int (not a bool) in [low, high]; None too when `optional`."""
    def rule(value: Any) -> str | None:
        if (optional and value is None) or (type(value) is int and low <= value <= high):
            return None
        return f"a whole number in [{low}, {high}]" + (" or null" if optional else "")
    return rule


def real(low: float, high: float = math.inf, *, low_open: bool = False,
         optional: bool = False) -> Rule:
    """A finite int or float (not a bool) in [low, high] (low excluded when `low_open`)."""
    def rule(value: Any) -> str | None:
        if optional and value is None:
            return None
        if type(value) in (int, float) and math.isfinite(value) \
                and (value > low if low_open else value >= low) and value <= high:
            return None
        where = f"{'>' if low_open else '>='} {low:g}" if high == math.inf \
            else f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        return f"a finite number {where}" + (" or null" if optional else "")
    return rule


def flag(value: Any) -> str | None:
    return None if type(value) is bool else "true or false (a boolean, not a string or number)"


def choice(*options: str) -> Rule:
    def rule(value: Any) -> str | None:
        return None if isinstance(value, str) and value in options \
            else f"one of {', '.join(options)}"
    return rule


def text(limit: int) -> Rule:
    def rule(value: Any) -> str | None:
        return None if isinstance(value, str) and len(value) <= limit \
            else f"a string of at most {limit} characters"
    return rule


def _model_rules() -> dict[str, Rule]:
    from models.rope_scaling import SCALING_TYPES

    return {
        "name": text(MAX_NAME),
        "num_layers": whole(1, MAX_LAYERS),
        "hidden_size": whole(1, MAX_HIDDEN),
        "num_attention_heads": whole(1, MAX_HEADS),
        "num_query_groups": whole(1, MAX_HEADS, optional=True),
        "ffn_hidden_size": whole(1, MAX_FFN, optional=True),
        "kv_channels": whole(1, MAX_HEAD_DIM, optional=True),
        "normalization": choice("RMSNorm", "LayerNorm"),
        "swiglu": flag,
        "qkv_bias": flag,
        "rope_theta": real(0, low_open=True),
        "rope_scaling_type": choice(*SCALING_TYPES),
        "rope_scaling_factor": real(0),  # 0: the run's length over the trained length
        "rope_original_max_position": whole(0, MAX_LENGTH),  # 0: the trained length
        "rope_low_freq_factor": real(0, low_open=True),
        "rope_high_freq_factor": real(0, low_open=True),
        "rope_beta_fast": real(0, low_open=True),
        "rope_beta_slow": real(0, low_open=True),
        "rope_attention_factor": real(0, low_open=True, optional=True),
        "untie_embeddings": flag,
        "init_std": real(0, low_open=True),
        "layernorm_epsilon": real(0, low_open=True),
        "make_vocab_size_divisible_by": whole(1, MAX_DIVISOR),
    }


def _attention_rules() -> dict[str, Rule]:
    return {
        "kind": choice(*AttentionKind),
        "dca_chunk_size": whole(1, MAX_LENGTH),
        "dca_local_size": whole(1, MAX_LENGTH),
        "dca_scaling": choice(*DCAScalingKind),
        "dca_scaling_parts": choice(*DCAScaledParts),
        "dca_scaling_attn_scale": real(0),
        "dca_scaling_floor_scale": whole(1, MAX_LENGTH),
        "dca_scaling_original_length": whole(1, MAX_LENGTH, optional=True),
        "chunk_size": whole(1, MAX_LENGTH),
        "global_layer_interval": whole(0, MAX_LAYERS),
        "head_wise_attn_gate": flag,
        "head_wise_attn_gate_init_weight_scale": real(0),
        "head_wise_attn_gate_init_bias": real(-1e4, 1e4),
    }


def show(value: Any) -> str:
    """A value as a message shows it: repr, cut at 80 characters."""
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def check_value(value: Any, rule: Rule, name: str) -> Any:
    """`value` when `rule` accepts it, else SettingError naming `name`."""
    expected = rule(value)
    if expected is not None:
        raise SettingError(f"{name}={show(value)} must be {expected}")
    return value


def _values(settings: Any, cls: type) -> dict[str, Any]:
    """Every field of `cls` from `settings` (a dataclass, a DictConfig or a mapping); a field it
    lacks takes the default (a saved config older than the field)."""
    out = {}
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        if isinstance(settings, Mapping):
            out[f.name] = settings.get(f.name, default)
        else:
            out[f.name] = getattr(settings, f.name, default)
    return out


def _model_name(key: str) -> str:
    return f"model.{key}"


def _attention_name(key: str) -> str:
    return f"attention.{key}"


def check_model_settings(model: Any, name: Name = _model_name) -> None:
    """Every `ModelConfig` value of `model` typed and in range, and the shape consistent (query
    groups dividing the heads, an even head dimension); `name` spells a field as the source
    does (`model.num_layers`, config.json's `num_hidden_layers`)."""
    values = _values(model, ModelConfig)
    for key, rule in _model_rules().items():
        check_value(values[key], rule, name(key))
    heads = values["num_attention_heads"]
    groups = values["num_query_groups"] or heads
    if groups > heads or heads % groups:
        raise SettingError(
            f"{name('num_attention_heads')} ({heads}) must be divisible by "
            f"{name('num_query_groups')} ({groups}): every query group serves the same number "
            "of heads; choose a num_query_groups that divides the head count")
    kv_channels = values["kv_channels"]
    if kv_channels is None and values["hidden_size"] % heads:
        raise SettingError(f"{name('hidden_size')} ({values['hidden_size']}) must be divisible "
                           f"by {name('num_attention_heads')} ({heads}), or set "
                           f"{name('kv_channels')}")
    head_dim = kv_channels or values["hidden_size"] // heads
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise SettingError(f"the head dimension ({head_dim}) must be even and at most "
                           f"{MAX_HEAD_DIM}: RoPE rotates pairs of channels; change "
                           f"{name('hidden_size')}, {name('num_attention_heads')} or "
                           f"{name('kv_channels')}")


def check_attention_settings(attention: Any, name: Name = _attention_name) -> None:
    """Every `AttentionConfig` value typed and in range, then the chosen variant's own check
    (models/attention/registry.py: DCA's local window inside its chunk, settings of another
    kind left at their defaults)."""
    from models.attention.registry import check_attention

    values = _values(attention, AttentionConfig)
    for key, rule in _attention_rules().items():
        check_value(values[key], rule, name(key))
    if values["kind"] == "dca" and values["dca_local_size"] >= values["dca_chunk_size"]:
        raise SettingError(
            f"{name('dca_chunk_size')} ({values['dca_chunk_size']}) must exceed "
            f"{name('dca_local_size')} ({values['dca_local_size']}): the chunk length is their "
            "difference; lower the local window or raise the chunk size")
    try:
        check_attention(AttentionConfig(**values))
    except ValueError as err:
        raise SettingError(f"attention settings: {err}") from None


def check_settings(model: Any, attention: Any, *, model_name: Name = _model_name,
                   attention_name: Name = _attention_name) -> None:
    """Both checks: the model's shape, then its attention."""
    check_model_settings(model, model_name)
    check_attention_settings(attention, attention_name)


def check_vocab(vocab_size: Any, name: str = "vocab_size") -> int:
    """A real vocabulary size: a whole number in [1, MAX_VOCAB]."""
    return check_value(vocab_size, whole(1, MAX_VOCAB), name)


def check_length(length: Any, name: str) -> int:
    """A sequence length or position count: a whole number in [1, MAX_LENGTH]."""
    return check_value(length, whole(1, MAX_LENGTH), name)
