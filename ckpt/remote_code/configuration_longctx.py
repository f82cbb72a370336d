"""transformers configuration of a longctx export: a Llama config whose "longctx" entry holds the
attention the model was trained with (see modeling_longctx.py)."""

from transformers import LlamaConfig


class LongCtxConfig(LlamaConfig):
    """`longctx`: {"attention": "standard" | "dca" | "chunked", "dca_chunk_size",
    "dca_local_size", "chunk_size", "global_layer_interval", "head_wise_attn_gate", "qkv_bias",
    "original_max_position_embeddings", and for DCA's logit scaling "dca_scaling" ("none" |
    "log" | "yarn"), "dca_scaling_parts", "dca_scaling_attn_scale", "dca_scaling_floor_scale",
    "dca_scaling_original_length"}."""

    model_type = "longctx"


class LongCtxQwen2Config(LongCtxConfig):
    """The same for a Qwen2-shaped DCA export that serving engines read as a Qwen2 model (its
    config.json keeps model_type "qwen2" and carries `dual_chunk_attention_config`)."""

    model_type = "qwen2"
