"""Layer specs: megatron's local GPT layer with our core attention plugged in through ModuleSpec."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from models.attention.head_gate import HeadGatedSelfAttention
from models.attention.registry import STANDARD, is_global_layer, variant
from models.config import LongContextConfig
from models.fused_qkv import GroupedQuerySelfAttention
from models.fused_rmsnorm import FusedRMSNorm


def layer_spec(config: LongContextConfig, core_attention: type) -> ModuleSpec:
    """megatron's local (Transformer-Engine-free) GPT layer spec with `core_attention` swapped in
    (and the head-gated self-attention when the gate is on: it works with any core; else, for a
    core that takes the query heads in their groups, the self-attention that hands them so)."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    if config.fused_rmsnorm:  # Triton RMSNorm (fused_rmsnorm.py) in place of torch.nn.RMSNorm
        spec.submodules.input_layernorm = FusedRMSNorm
        spec.submodules.pre_mlp_layernorm = FusedRMSNorm
    if config.attention.head_wise_attn_gate:
        spec.submodules.self_attention.module = HeadGatedSelfAttention
    elif core_attention.takes_grouped_query:  # no query copy, no gradient concatenation
        spec.submodules.self_attention.module = GroupedQuerySelfAttention
    return spec


def block_spec(config: LongContextConfig,
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage (model chunk `vp_stage`), so layers may differ
    (chunked attention's global layers, numbered globally), and the block's final norm (megatron
    adds it only for a single shared layer spec, and builds it on the last stage only).

    The slice is megatron's own (`get_gpt_decoder_block_spec` does the same): this stage's layer
    count and its offset among all layers.
    """
    local = variant(config.attention.kind).core_attention()
    causal = STANDARD.core_attention()
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = [
        layer_spec(config, causal if is_global_layer(config.attention, n) else local)
        for n in range(offset + 1, offset + count + 1)
    ]
    # The final norm before the output layer: the same norm the layers use (RMSNorm/LayerNorm).
    final_norm = layer_spec(config, local).submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)

