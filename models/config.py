"""megatron `TransformerConfig` extended with our attention variants' settings, validated early."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.transformer.transformer_config import TransformerConfig

from models.attention.registry import check_attention
from models.options import DCABackward
from models.rope_scaling import NO_SCALING, RopeScaling
from models.schema import AttentionConfig


@dataclass
class LongContextConfig(TransformerConfig):
    """TransformerConfig plus the long-context attention settings.

    attention: the typed attention settings (models.schema.AttentionConfig; its kind's variant
    in models/attention/registry.py), carried whole rather than copied field by field.
    dca_cuda_graphs: DCA's passes replayed as CUDA graphs (models/attention/dca/graphs.py).
    dca_backward, dca_keep_rotated: DCA's path under FA4 and whether its backward takes the
    forward's rotated q and k (models/attention/dca/grouped.py); run settings like the graphs
    (models.options.BuildOptions), not part of `attention`, what the model is.
    recompute_keep_attention: under full recompute, each core attention keeps its output and LSE
    from the first forward instead of running again (models/recompute.py).
    cp_overlap: under context parallelism, the K/V exchange runs behind the attention's compute
    (False: each exchange is waited for before computing; models/attention/context_parallel.py).
    A run setting (`parallel.cp_overlap`), like the ones above.
    """

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = NO_SCALING  # context scaling of every RoPE (models/rope_scaling.py)
    dca_cuda_graphs: bool = False
    dca_backward: DCABackward = DCABackward.auto
    dca_keep_rotated: bool = False
    recompute_keep_attention: bool = False  # full recompute keeps core-attention results
    fused_rmsnorm: bool = False  # the layers' RMSNorms as one Triton pass (models/fused_rmsnorm.py)
    cp_overlap: bool = True

    def __post_init__(self) -> None:
        if self.attention.head_wise_attn_gate:
            # Before megatron's own checks, so a TP size that only the gate rules out says so.
            self._validate_head_gate()
        super().__post_init__()
        variant = check_attention(self.attention)
        if self.dca_backward not in tuple(DCABackward):
            raise ValueError(f"dca_backward must be one of {', '.join(DCABackward)}, got "
                             f"{self.dca_backward!r}")
        if self.fused_rmsnorm and self.normalization != "RMSNorm":
            raise ValueError(f"fused_rmsnorm needs normalization RMSNorm, not {self.normalization}")
        if self.sequence_parallel and not self.fused_rmsnorm:
            # megatron's torch norms (the local layer spec's) assert the same, deep in the build
            raise ValueError("sequence_parallel needs fused_rmsnorm (an RMSNorm model): the "
                             "torch norms do not sum their weight gradients over the TP ranks")
        if self.recompute_keep_attention and self.recompute_granularity != "full":
            raise ValueError("recompute_keep_attention applies to full recompute only "
                             f"(recompute_granularity is {self.recompute_granularity!r})")
        if variant.own_rope and self.apply_rope_fusion:
            raise ValueError(f"apply_rope_fusion must be off with attention kind {variant.name!r}: "
                             "it applies its own RoPE")

    def _validate_head_gate(self) -> None:
        tp = self.tensor_model_parallel_size
        groups = self.num_query_groups or self.num_attention_heads
        if self.attention_output_gate:
            raise ValueError(
                "head_wise_attn_gate and megatron's attention_output_gate are two output gates "
                "fused into linear_qkv; turn one of them off"
            )
        if self.num_attention_heads % tp:
            raise ValueError(
                f"head_wise_attn_gate needs num_attention_heads ({self.num_attention_heads}) "
                f"divisible by the TP size ({tp}): each rank gates its own heads; choose a "
                "parallel.tp that divides the head count"
            )
        if groups < tp or groups % tp:
            raise ValueError(
                f"head_wise_attn_gate needs num_query_groups ({groups}) >= the TP size ({tp}) "
                "and divisible by it, so no query group is split across ranks; lower parallel.tp "
                "or raise model.num_query_groups"
            )
