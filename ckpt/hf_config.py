"""Hugging Face `config.json` <-> our `ModelConfig`, for the Llama, Qwen2 and Mistral families.

Reads both config styles: `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters`
(transformers 5). Anything our model cannot reproduce exactly is refused with `HFError` naming
the setting: another activation, biases beyond Qwen2's q/k/v, a sliding window shorter than the
trained length, partial rotary, unknown RoPE scaling types.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.schema import AttentionConfig, ModelConfig, head_dim_of
from models.validation import (
    SettingError,
    check_attention_settings,
    check_length,
    check_model_settings,
    check_value,
    flag,
)

if TYPE_CHECKING:  # annotations only: the reader loads torch; `read_config` runs before it
    from ckpt.reader import Checkpoint

# architecture -> (model_type, q/k/v biases always on)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    # our remote-code exports (ckpt/remote_code/): biases per their "longctx" settings
    "LongCtxForCausalLM": ("longctx", False),
}
FAMILY_ARCHITECTURE = {family: arch for arch, (family, _) in ARCHITECTURES.items()}
# Our ModelConfig field <- HF rope scaling key.
_ROPE_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_original_max_position": "original_max_position_embeddings",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_attention_factor": "attention_factor",
}
# The keys transformers reads for each rope type (others make it warn "Unrecognized keys").
_ROPE_TYPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor"),
}
# transformers' "dynamic" rescales with the running length (unscaled up to the trained length);
# ours is the static NTK base, a different function: not imported.
_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# Sizes that must be whole numbers >= 1 where given (a missing one is defaulted or refused later).
_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
          "vocab_size", "max_position_embeddings", "num_key_value_heads", "head_dim",
          "sliding_window")

# Flags the import reads: each must be a JSON boolean where given (transformers refuses others).
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
# Our ModelConfig field -> the config.json key that holds it, in messages.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_query_groups": "num_key_value_heads",
             "ffn_hidden_size": "intermediate_size", "kv_channels": "head_dim",
             "layernorm_epsilon": "rms_norm_eps", "untie_embeddings": "tie_word_embeddings",
             "rope_scaling_factor": "rope_scaling.factor",
             "rope_original_max_position": "rope_scaling.original_max_position_embeddings"}
# The "longctx" block an export writes (ckpt/hf_export.py): its keys, each one of ours.
_SCALING_KEYS = ("dca_scaling", "dca_scaling_parts", "dca_scaling_attn_scale",
                 "dca_scaling_floor_scale", "dca_scaling_original_length")
_LONGCTX_KEYS = ("attention", "head_wise_attn_gate", "qkv_bias", "dca_chunk_size",
                 "dca_local_size", "chunk_size", "global_layer_interval",
                 "original_max_position_embeddings", *_SCALING_KEYS)
REMOTE_CODE_FILES = ("configuration_longctx.py", "modeling_longctx.py", "longctx_attention.py")


class HFError(RuntimeError):
    """A Hugging Face checkpoint that cannot be imported or a checkpoint that cannot be exported
    (the message names the file or setting)."""


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise HFError(f"{path}: no config.json (HF_DIR must be a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path}: must hold a JSON object of settings, not a "
                      f"{type(cfg).__name__}")
    return cfg


def check_values(cfg: dict[str, Any], path: Path) -> None:
    """Every size a whole number >= 1 and the scaling settings objects, before anything uses
    them (a string or a list there would surface as a traceback far from its cause)."""
    for key in _SIZES:
        value = cfg.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise HFError(f"{path}: {key}={value!r} must be a whole number >= 1; fix it in "
                          "config.json")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list)
                                  and all(isinstance(a, str) for a in archs)):
        raise HFError(f"{path}: architectures={archs!r} must be a list of class names")
    for key in ("rope_parameters", "rope_scaling", "longctx"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise HFError(f"{path}: {key}={cfg[key]!r:.80} must be an object of settings (or "
                          "null)")
    for key in _FLAGS:  # "false" (a string) is true in Python: a tied model would import
        if cfg.get(key) is not None and type(cfg[key]) is not bool:
            raise HFError(f"{path}: {key}={cfg[key]!r:.80} must be true or false (a JSON "
                          "boolean, not a string or number); fix it in config.json")
    for key in ("hidden_act", "model_type"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise HFError(f"{path}: {key}={cfg[key]!r:.80} must be a string")


def _positive(value: Any, key: str, path: Path) -> float | int:
    """`value` itself when a finite number > 0, else HFError naming `key`."""
    if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
        raise HFError(f"{path}: {key}={value!r} must be a finite number > 0; fix it in "
                      "config.json")
    return value


def architecture(cfg: dict[str, Any], path: Path) -> tuple[str, bool]:
    """(architecture name, q/k/v bias) of a supported family, else HFError."""
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise HFError(f"{path}: architecture {archs or '(none given)'} is not supported; "
                      f"import-hf reads {sorted(ARCHITECTURES)}")
    arch = known[0]
    bias = ARCHITECTURES[arch][1] or (cfg.get("longctx") or {}).get("qkv_bias") is True
    if cfg.get("attention_bias"):  # Llama's flag also puts a bias on o_proj
        raise HFError(f"{path}: attention_bias=true (biases on q/k/v/o) is not supported")
    return arch, bias


def _rope(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Our rope_* fields from either config style."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params.update(scaling)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise HFError(f"{path}: rope scaling type {kind!r} is not supported; import-hf "
                      f"reproduces {list(_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"{path}: partial_rotary_factor != 1 is not supported")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")
                           or params.get("truncate") is False):
        raise HFError(f"{path}: yarn with mscale/mscale_all_dim/truncate=false is not "
                      "reproduced; give attention_factor instead")
    out: dict[str, Any] = {"rope_theta": float(_positive(theta, "rope_theta", path)),
                           "rope_scaling_type": "none" if kind == "default" else kind}
    if kind != "default":
        for ours, theirs in _ROPE_KEYS.items():
            if params.get(theirs) is not None:
                out[ours] = _positive(params[theirs], theirs, path)
        if kind == "yarn" and "rope_original_max_position" not in out:
            out["rope_original_max_position"] = cfg["max_position_embeddings"]
    return out


def _check_window(cfg: dict[str, Any], path: Path) -> None:
    """A sliding window shorter than the trained length changes the function: refuse it."""
    window = cfg.get("sliding_window")
    in_use = cfg.get("use_sliding_window", True)  # Qwen2 has the flag, Mistral does not
    trained = cfg.get("max_position_embeddings", 0)
    if window and in_use and window < trained:
        raise HFError(f"{path}: sliding_window={window} is shorter than "
                      f"max_position_embeddings={trained}; sliding-window attention is not "
                      "supported (a window covering the trained length is)")


def model_config(cfg: dict[str, Any], path: Path) -> ModelConfig:
    """Our model config for an HF config.json (`path` names it in errors)."""
    check_values(cfg, path)
    arch, bias = architecture(cfg, path)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFError(f"{path}: hidden_act={cfg['hidden_act']!r} is not supported (SwiGLU with "
                      "silu only)")
    if cfg.get("mlp_bias"):
        raise HFError(f"{path}: mlp_bias=true is not supported")
    _check_window(cfg, path)
    try:
        heads = cfg["num_attention_heads"]
        model = ModelConfig(
            name=f"hf-{ARCHITECTURES[arch][0]}",
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            ffn_hidden_size=cfg["intermediate_size"],
            kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            normalization="RMSNorm",
            swiglu=True,
            qkv_bias=bias,
            untie_embeddings=not cfg.get("tie_word_embeddings", False),
            layernorm_epsilon=_positive(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps",
                                        path),
            **_rope(cfg, path),
        )
    except KeyError as e:
        raise HFError(f"{path}: missing setting {e}") from None
    try:  # the check every model source shares (models/validation.py), named as config.json does
        check_model_settings(model, lambda key: _HF_NAMES.get(key, key))
    except SettingError as e:
        raise HFError(f"{path}: {e}; fix it in config.json") from None
    return model


def attention_config(cfg: dict[str, Any], path: Path = Path("config.json")) -> AttentionConfig:
    """The attention an export recorded under config.json's "longctx" key (standard if none),
    every value checked (`models.validation`). A config that carries our remote code (its
    auto_map, architecture or model_type) without the block is refused: it would import as
    standard attention without a word."""
    settings = cfg.get("longctx")
    if settings is None:
        if _carries_remote_code(cfg, path.parent):
            raise HFError(f'{path}: the model runs our remote code (auto_map / LongCtxForCausalLM'
                          f' / {REMOTE_CODE_FILES[1]}), but config.json has no "longctx" block '
                          "naming its attention: restore the block (or export the checkpoint "
                          "again) instead of importing it as standard attention")
        return AttentionConfig()
    if not isinstance(settings, dict):
        raise HFError(f'{path}: "longctx"={settings!r:.80} must be an object of settings')
    unknown = sorted(set(settings) - set(_LONGCTX_KEYS))
    if unknown:
        raise HFError(f'{path}: "longctx" holds settings {unknown} that no export writes; '
                      f"it knows {list(_LONGCTX_KEYS)}")
    values = {key: settings[key] for key in ("dca_chunk_size", "dca_local_size", "chunk_size",
                                             "global_layer_interval", "head_wise_attn_gate",
                                             *_SCALING_KEYS)
              if key in settings}
    att = AttentionConfig(kind=settings.get("attention", "standard"), **values)
    try:
        check_value(settings.get("qkv_bias", False), flag, '"longctx".qkv_bias')
        if "original_max_position_embeddings" in settings:
            check_length(settings["original_max_position_embeddings"],
                         '"longctx".original_max_position_embeddings')
        check_attention_settings(att, lambda key: '"longctx".' + ("attention" if key == "kind"
                                                                  else key))
    except SettingError as e:
        raise HFError(f"{path}: {e}; fix it in config.json") from None
    return att


def _carries_remote_code(cfg: dict[str, Any], hf_dir: Path) -> bool:
    auto_map = cfg.get("auto_map")
    return ("LongCtxForCausalLM" in (cfg.get("architectures") or [])
            or cfg.get("model_type") == "longctx"
            or "longctx" in json.dumps(auto_map if isinstance(auto_map, dict) else {})
            or any((hf_dir / name).is_file() for name in REMOTE_CODE_FILES[:2]))


def _rope_config(model: ModelConfig) -> dict[str, Any]:
    """rope_theta and, when scaled, rope_scaling with only the keys transformers knows for the
    type. Our static NTK base (ntk, dynamic) is plain RoPE at a larger theta, written so."""
    kind, theta = model.rope_scaling_type, model.rope_theta
    if kind in ("ntk", "dynamic"):
        d = head_dim_of(model)
        return {"rope_theta": theta * model.rope_scaling_factor ** (d / (d - 2))}
    if kind == "none":
        return {"rope_theta": theta}
    theirs = {v: k for k, v in _ROPE_KEYS.items()}
    scaling: dict[str, Any] = {"rope_type": kind}
    for key in _ROPE_TYPE_KEYS[kind]:
        value = getattr(model, theirs[key])
        if value is not None:
            scaling[key] = value
    return {"rope_theta": theta, "rope_scaling": scaling}


def hf_config(model: ModelConfig, vocab_size: int, max_positions: int, dtype: str,
              extra: dict[str, Any], family: str | None = None) -> dict[str, Any]:
    """An HF config.json for our model: `family` llama, mistral or qwen2 (default: Qwen2 when it
    has q/k/v biases, else Llama)."""
    family = family or ("qwen2" if model.qkv_bias else "llama")
    cfg: dict[str, Any] = {
        "architectures": [FAMILY_ARCHITECTURE[family]],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
        "head_dim": head_dim_of(model),
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": model.layernorm_epsilon,
        "tie_word_embeddings": not model.untie_embeddings,
        **_rope_config(model),
        "torch_dtype": dtype,
        **extra,
    }
    if family == "qwen2":
        cfg["use_sliding_window"] = False
    elif family == "mistral":
        cfg["sliding_window"] = None
    else:
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    return cfg


def source_config(ckpt: Checkpoint) -> dict[str, Any]:
    """The config.json of the Hugging Face model the checkpoint was imported from (kept through
    fine-tunes in the record's `hf_source`), or {}."""
    source = ckpt.meta.hf_source
    return json.loads(source.config_json) if source and source.config_json else {}


def model_max_positions(ckpt: Checkpoint) -> int:
    """The model's own context length: the imported model's `max_position_embeddings` (its
    original one, if an export recorded a longer length for DCA), else the trained length."""
    hf = source_config(ckpt)
    own = (hf.get("longctx") or {}).get("original_max_position_embeddings") \
        or hf.get("max_position_embeddings")
    return int(own or ckpt.meta.seq_length)
