"""The one model factory: a megatron `GPTModel` from typed model, attention and parallel configs.

`build_model` is what the trainer, `trainer.eval` and `python -m ckpt` call; `transformer_config`
and `build_gpt` are its two steps (the megatron config, then the module tree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from models.attention import kernels
from models.attention.registry import no_rope_pattern, variant
from models.config import LongContextConfig
from models.fused_rope import install as install_fused_rope
from models.options import BuildOptions
from models.rope_scaling import RopeScaling, rope_frequencies
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from models.spec import block_spec


@dataclass
class BuiltModel:
    """A freshly built model (this rank's pipeline chunks) and what its callers need beside it."""

    chunks: list[GPTModel]  # one per virtual pipeline stage; one without interleaving
    config: LongContextConfig
    vocab_size: int  # the padded vocabulary: rows of the embedding and output layer
    attention_kernel: str = "math"  # what options.attention_kernel resolved to: run labels

    @property
    def gpt(self) -> GPTModel:
        """The model of a run without interleaved pipeline stages (its one chunk)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this model has {len(self.chunks)} pipeline chunks; use .chunks")
        return self.chunks[0]


def tp_problems(model: ModelConfig, tp: int) -> list[str]:
    """What keeps the model's layers from splitting over `tp` ranks (empty: they split); the
    vocabulary is the caller's (padded at build time, or fixed in a checkpoint)."""
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    ffn = ffn_hidden_size(model)
    problems = []
    if heads % tp:
        problems.append(f"model.num_attention_heads ({heads}) is not divisible by {tp}")
    if groups % tp:
        problems.append(f"model.num_query_groups ({groups}) is not divisible by {tp}: each rank "
                        "needs whole query groups (K/V heads)")
    if ffn % tp:
        problems.append(f"the MLP hidden size ({ffn}) is not divisible by {tp}")
    return problems


def ffn_hidden_size(model: ModelConfig) -> int:
    """Explicit size, else 4h (or SwiGLU's 8h/3 rounded up to a multiple of 64)."""
    if model.ffn_hidden_size is not None:
        return model.ffn_hidden_size
    if model.swiglu:
        return 64 * math.ceil(8 * model.hidden_size / 3 / 64)
    return 4 * model.hidden_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Pad to a multiple of `divisible_by` alone, so the embedding's global shape is the same at
    every TP size (checkpoints reshard); the padded size must then divide by tp."""
    padded = divisible_by * math.ceil(vocab_size / divisible_by)
    if padded % tp:
        raise ValueError(
            f"padded vocabulary ({padded}) must divide by tp ({tp}); raise "
            "model.make_vocab_size_divisible_by to a multiple of tp"
        )
    return padded


def recompute_options(recompute: str, modules: list[str], num_layers: int, keep_attention: bool,
                      model_layers: int) -> dict[str, Any]:
    """megatron's recompute settings for `trainer.recompute*` (see TrainerConfig).

    full: every layer (uniform, one layer per checkpoint) or the first `num_layers` (block);
    `keep_attention` keeps each core attention's result instead of re-running it.
    selective: megatron's `recompute_modules` (its default, core_attn, when empty).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"trainer.recompute={recompute!r}: choose none, selective or full")
    if modules and recompute != "selective":
        raise ValueError(f"trainer.recompute_modules={modules} needs trainer.recompute=selective")
    if num_layers and recompute != "full":
        raise ValueError(f"trainer.recompute_num_layers={num_layers} needs trainer.recompute=full")
    if not 0 <= num_layers <= model_layers:
        raise ValueError(f"trainer.recompute_num_layers={num_layers} must be in [0, "
                         f"model.num_layers ({model_layers})]; 0 recomputes every layer")
    if recompute == "full":
        method = dict(recompute_method="block", recompute_num_layers=num_layers) if num_layers \
            else dict(recompute_method="uniform", recompute_num_layers=1)
        return dict(recompute_granularity="full", recompute_keep_attention=keep_attention,
                    **method)
    if recompute == "selective":
        # megatron-core 0.16's "layernorm" recompute (CheckpointWithoutOutput) calls Transformer
        # Engine even without fp8, so it fails without TE; its MoE/MLA modules do not apply.
        allowed = ("core_attn", "mlp")
        unknown = [m for m in modules if m not in allowed]
        if unknown:
            raise ValueError(f"trainer.recompute_modules: {unknown} not supported here; choose "
                             f"from {list(allowed)}")
        return dict(recompute_granularity="selective", recompute_modules=modules or None)
    return {}


def rope_scaling(model: ModelConfig) -> RopeScaling:
    """The model's RoPE context scaling settings (validated); a config saved before these
    fields existed (an older checkpoint's) means no scaling."""
    default = ModelConfig()

    def get(name: str) -> Any:
        return getattr(model, name, getattr(default, name))

    return RopeScaling(
        type=get("rope_scaling_type"), factor=get("rope_scaling_factor"),
        original_max_position=get("rope_original_max_position"),
        low_freq_factor=get("rope_low_freq_factor"), high_freq_factor=get("rope_high_freq_factor"),
        beta_fast=get("rope_beta_fast"), beta_slow=get("rope_beta_slow"),
        attention_factor=get("rope_attention_factor"),
    )


def typed_attention(attention: AttentionConfig) -> AttentionConfig:
    """An `AttentionConfig` of these settings (a Hydra DictConfig or a saved config's), so the
    megatron config carries one typed object; a setting the config lacks raises AttributeError."""
    return AttentionConfig(**{f.name: getattr(attention, f.name) for f in fields(AttentionConfig)})


def transformer_config(model: ModelConfig, attention: AttentionConfig,
                       parallel: ParallelConfig | None = None,
                       options: BuildOptions = BuildOptions()) -> LongContextConfig:
    """The megatron config for a model shape, attention variant, parallel layout (default: one
    rank) and run options.

    `options.fused_rope` turns on megatron's `apply_rope_fusion` with our Triton kernels
    (models/fused_rope.py) for the layers megatron rotates, and, where it rotates every layer,
    its `fused_single_qkv_rope` (the QKV split and RoPE in one pass); a variant that rotates q
    and k itself (DCA, in its own fused kernels) is unaffected. `options.dca_cuda_graphs` (DCA
    on the GPU only) replays DCA's passes as CUDA graphs (models/attention/dca/graphs.py);
    `options.dca_backward` and `dca_keep_rotated` pick DCA's path under FA4 (dca/grouped.py).
    """
    attention, parallel = typed_attention(attention), parallel or ParallelConfig()
    tp, pp, o = parallel.tp, parallel.pp, options
    vpp = parallel.vpp if parallel.vpp and parallel.vpp > 1 else None
    rope_fusion = o.fused_rope and not variant(attention.kind).own_rope
    if rope_fusion:
        install_fused_rope()
    no_rope = no_rope_pattern(attention, model.num_layers)
    recompute_kwargs = recompute_options(o.recompute, list(o.recompute_modules),
                                         o.recompute_num_layers, o.recompute_keep_attention,
                                         model.num_layers)
    return LongContextConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        ffn_hidden_size=ffn_hidden_size(model),
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        init_method_std=model.init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=parallel.cp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # The dtype of the activations sent between stages (megatron asks for it under PP).
        pipeline_dtype=(torch.bfloat16 if o.bf16 else torch.float32) if pp > 1 else None,
        sequence_parallel=parallel.sequence_parallel,
        cp_overlap=parallel.cp_overlap,
        bf16=o.bf16,
        params_dtype=torch.bfloat16 if o.bf16 else torch.float32,
        use_cpu_initialization=not o.on_gpu,
        perform_initialization=o.initialize,
        # Fusions that need CUDA (jit/Triton) are on only on the GPU; apex/TE ones stay off.
        bias_activation_fusion=o.on_gpu and model.swiglu,
        bias_dropout_fusion=o.on_gpu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=rope_fusion,
        # the split of the fused QKV and its RoPE as one pass each way (models/fused_rope.py);
        # megatron takes that path only if every layer rotates, and asserts that it can
        fused_single_qkv_rope=rope_fusion and no_rope is None,
        fused_rmsnorm=o.fused_norm and model.normalization == "RMSNorm",
        no_rope_freq=no_rope,
        attention=attention,
        rope_theta=model.rope_theta,
        rope_scaling=rope_scaling(model),
        dca_cuda_graphs=o.dca_cuda_graphs and o.on_gpu,
        dca_backward=o.dca_backward,
        dca_keep_rotated=o.dca_keep_rotated,
        **recompute_kwargs,
    )


def build_gpt(config: LongContextConfig, vocab_size: int, max_sequence_length: int,
              untie_embeddings: bool = False, vp_stage: int | None = None) -> GPTModel:
    """GPTModel with RoPE and our per-layer specs for this rank's pipeline stage (model chunk
    `vp_stage` of it when interleaved); `vocab_size` is the padded size. The first stage holds
    the embedding, the last the final norm and output layer (tied to the embedding across the
    two, as megatron ties them).

    megatron's RotaryEmbedding computes plain (or its own llama3) frequencies, so ours
    (models/rope_scaling.py) replace them before the first forward caches any table; the
    attention factor is applied by the core attentions (models/attention/core.py)."""
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                           vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                           vp_stage=vp_stage),
        share_embeddings_and_output_weights=not untie_embeddings,
        position_embedding_type="rope",
        rotary_base=config.rope_theta,
        vp_stage=vp_stage,
    )
    rotary = gpt.rotary_pos_emb
    inv_freq, _ = rope_frequencies(config.kv_channels, config.rope_theta, config.rope_scaling,
                                   device=rotary.inv_freq.device)
    rotary.inv_freq = inv_freq
    return gpt


def build_model(model: ModelConfig, attention: AttentionConfig, parallel: ParallelConfig, *,
                vocab_size: int, max_sequence_length: int,
                options: BuildOptions = BuildOptions()) -> BuiltModel:
    """This rank's part of the GPT for a model shape, attention variant and parallel layout (its
    pipeline stage: `parallel.vpp` chunks when interleaved, else one), on the GPU when
    `options.on_gpu`. megatron's parallel state must be initialised for `parallel`.
    `vocab_size` is the tokenizer's (or a checkpoint's already padded) size; it is padded as
    every TP size pads it, so checkpoints keep one embedding shape."""
    # Every attention call of this process uses the kernel the setting resolves to here.
    kernel = kernels.use(str(options.attention_kernel), cuda=options.on_gpu)
    vocab = padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by, parallel.tp)
    config = transformer_config(model, attention, parallel, options)
    vpp = config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    chunks = [build_gpt(config, vocab, max_sequence_length, model.untie_embeddings, vp_stage=v)
              for v in stages]
    if options.on_gpu:
        for chunk in chunks:
            chunk.cuda()
    return BuiltModel(chunks, config, vocab, kernel)
