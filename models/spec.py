"""Layer specs: megatron's local GPT layer with our core attention plugged in through ModuleSpec."""

from __future__ import annotations

import importlib

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from models.attention.head_gate import HeadGatedSelfAttention
from models.config import LongContextConfig
from models.fused import FusedRMSNorm

# attention kind -> "module:Class" of its core attention; imported lazily so each variant's
# dependencies load only when it is used.
CORE_ATTENTION = {
    "standard": "models.attention.core:CausalCoreAttention",
    "dca": "models.attention.dca.module:DCACoreAttention",
    "chunked": "models.attention.chunked_module:ChunkedCoreAttention",
}


def core_attention_class(kind: str) -> type:
    """The megatron core-attention module class registered for an attention kind."""
    module, name = CORE_ATTENTION[kind].split(":")
    return getattr(importlib.import_module(module), name)


def layer_spec(config: LongContextConfig, core_attention: type) -> ModuleSpec:
    """megatron's local (Transformer-Engine-free) GPT layer spec with `core_attention` swapped in
    (and the head-gated self-attention when the gate is on: it works with any core)."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    if config.fused_rmsnorm:  # Triton RMSNorm (models/fused.py) in place of torch.nn.RMSNorm
        spec.submodules.input_layernorm = FusedRMSNorm
        spec.submodules.pre_mlp_layernorm = FusedRMSNorm
    if config.head_wise_attn_gate:
        spec.submodules.self_attention.module = HeadGatedSelfAttention
    return spec


def is_global_layer(config: LongContextConfig, layer_number: int) -> bool:
    """Chunked attention's interleaved global layers (1-based layer numbers N, 2N, ...)."""
    interval = config.global_layer_interval
    return config.attention_kind == "chunked" and interval > 0 and layer_number % interval == 0


def block_spec(config: LongContextConfig,
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage (model chunk `vp_stage`), so layers may differ
    (chunked attention's global layers, numbered globally), and the block's final norm (megatron
    adds it only for a single shared layer spec, and builds it on the last stage only).

    The slice is megatron's own (`get_gpt_decoder_block_spec` does the same): this stage's layer
    count and its offset among all layers.
    """
    local = core_attention_class(config.attention_kind)
    causal = core_attention_class("standard")
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = [
        layer_spec(config, causal if is_global_layer(config, n) else local)
        for n in range(offset + 1, offset + count + 1)
    ]
    # The final norm before the output layer: the same norm the layers use (RMSNorm/LayerNorm).
    final_norm = layer_spec(config, local).submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)


def no_rope_pattern(kind: str, num_layers: int, global_layer_interval: int) -> list[int] | None:
    """megatron's `no_rope_freq` list (1 = the layer skips RoPE).

    DCA rotates q and k itself with its per-part positions, so every layer skips the standard
    RoPE; chunked attention's global layers use no positional encoding at all (Llama 4's iRoPE).
    """
    if kind == "dca":
        return [1] * num_layers
    if kind == "chunked" and global_layer_interval > 0:
        return [int(n % global_layer_interval == 0) for n in range(1, num_layers + 1)]
    return None
