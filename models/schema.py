"""Typed schema of what a model *is* and how it is laid out: shape, attention variant, parallelism.

These dataclasses are the `model`, `attention` and `parallel` groups of the Hydra config
(`trainer/config.py` composes them into the run's schema) and the inputs of the one model
factory, `models.gpt.build_model`. They hold plain values only, so a checkpoint's saved config
rebuilds the same model anywhere (`ckpt`, `trainer.eval`).

How a model *runs* (its GPU kernel, DCA's backward path, precision, recompute) is not here:
those are the run's settings (`trainer` group, `models.options.BuildOptions`).

Every setting with a fixed set of values is a `StrEnum` (declared once, here for the model's):
Hydra refuses any other value when it composes the config, and a member still equals its
string (`kind == "dca"`) and writes as it (JSON, YAML).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AttentionKind(StrEnum):
    """`attention.kind`: the names of models/attention/registry.py's variants (one each)."""

    standard = "standard"
    dca = "dca"
    chunked = "chunked"


class DCAScalingKind(StrEnum):
    """`attention.dca_scaling` (models/attention/dca/scaling.py)."""

    none = "none"
    log = "log"  # Llama 4's attn_temperature_tuning
    yarn = "yarn"  # Qwen2.5-1M's YaRN temperature


class DCAScaledParts(StrEnum):
    """`attention.dca_scaling_parts`: which of DCA's three parts the scaling multiplies."""

    all = "all"
    succ_inter = "succ_inter"
    inter = "inter"


@dataclass
class ModelConfig:
    """Transformer shape. Sizes live in `conf/model/*.yaml` (the model registry)."""

    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (one group per head)
    ffn_hidden_size: int | None = None  # None: 4h (or 8h/3 rounded to 64 with SwiGLU)
    kv_channels: int | None = None  # None: hidden_size / num_attention_heads
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    swiglu: bool = True
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    # RoPE context scaling (models/rope_scaling.py): none | linear (PI) | ntk | dynamic
    # (= ntk) | yarn | llama3. Set at eval time with `+extrapolation=pi|ntk|yarn`.
    rope_scaling_type: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_max_position: int = 0  # the pretraining length (llama3, yarn)
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float | None = None  # yarn's cos/sin factor (None: 0.1 ln(s) + 1)
    untie_embeddings: bool = False
    init_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128


def head_dim_of(model: ModelConfig) -> int:
    """The attention head's width: kv_channels, or hidden_size / num_attention_heads (a
    ModelConfig or the config group holding its fields)."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


@dataclass
class AttentionConfig:
    """Core attention variant. `+attention=<name>` selects one of `conf/attention/*.yaml`."""

    kind: AttentionKind = AttentionKind.standard  # the core (models/attention/registry.py)
    # DCA's chunk C and local window w (chunk length C - w). Under +attention=dca, unset: the
    # run's seq_length / 4 (at most 8192) and C / 8 for a model trained from scratch; for an
    # existing model (eval, generate, a fine-tune, export) the sizes it was trained with, or
    # 3T/4 and T/16 of its length T (dca_pretrained_split)
    dca_chunk_size: int = 8192
    dca_local_size: int = 1024
    # Length-dependent logit scaling for DCA (models/attention/dca/scaling.py; defaults: the
    # sources'): log (Llama 4), yarn (Qwen2.5-1M)
    dca_scaling: DCAScalingKind = DCAScalingKind.none
    # the parts it scales: all, succ_inter (successive and inter-chunk), inter
    dca_scaling_parts: DCAScaledParts = DCAScaledParts.all
    dca_scaling_attn_scale: float = 0.1
    dca_scaling_floor_scale: int = 8192  # log only; unset on a pretrained model: its length
    dca_scaling_original_length: int | None = None  # yarn only; None: dca_chunk_size
    chunk_size: int = 8192  # chunked: a query sees its chunk (unset: seq_length / 4, <= 8192)
    global_layer_interval: int = 0  # chunked: every Nth layer global causal without RoPE (0: none)
    head_wise_attn_gate: bool = False
    head_wise_attn_gate_init_weight_scale: float = 0.1
    head_wise_attn_gate_init_bias: float = 2.0


def dca_pretrained_split(length: int) -> tuple[int, int]:
    """DCA's (dca_chunk_size, dca_local_size) for a model pretrained at `length` tokens:
    ChunkLlama's split (HKUNLP/ChunkLlama `replace_with_chunkllama`), chunk 3T/4 and local window
    T/16, the one that kept a real pretrained model's retrieval at 4T (docs/experiments.md)."""
    return max(2, 3 * int(length) // 4), max(1, int(length) // 16)


def dca_local_within(local: int, chunk: int) -> int:
    """A DCA local window where a chunk size was chosen apart from it: kept while below the
    chunk, else a twelfth of the chunk (ChunkLlama's ratio, T/16 of a 3T/4 chunk)."""
    return int(local) if local < chunk else max(1, int(chunk) // 12)


def dca_pretrained_log_floor(length: int) -> int:
    """The `log` scaling's floor_scale for DCA applied to a model pretrained at `length` tokens
    without DCA: that length, so the temperature is 1 within the length the model knows."""
    return int(length)


@dataclass
class ParallelConfig:
    """Model parallelism; data parallelism takes the remaining ranks (world / (tp x cp x pp))."""

    tp: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages (megatron's 1F1B schedule)
    vpp: int | None = None  # model chunks per stage (interleaved 1F1B); None or 1: no interleaving
    # TP > 1: the norms and residual adds on 1/tp of the tokens per rank (megatron's); needs
    # trainer.fused_norm=true, whose RMSNorm sums its weight gradients over the TP ranks
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    # CP: exchange K/V (and send dK/dV back) while the attention computes; false: wait for each
    # exchange before computing (to measure what the overlap hides). How a run runs, not what the
    # model is: a checkpoint's layout leaves it out
    cp_overlap: bool = True
