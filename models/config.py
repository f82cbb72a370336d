"""megatron `TransformerConfig` extended with our attention variants' settings, validated early."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from models.attention.dca.scaling import DCAScaling
from models.rope_scaling import NO_SCALING, RopeScaling

ATTENTION_KINDS = ("standard", "dca", "chunked")


@dataclass
class LongContextConfig(TransformerConfig):
    """TransformerConfig plus the long-context attention settings.

    attention_kind: "standard" (causal SDPA), "dca" (Dual Chunk Attention) or "chunked"
    (Llama-4 style local chunks; every `global_layer_interval`-th layer global without RoPE).
    head_wise_attn_gate: a sigmoid gate per head on the attention output, fused into linear_qkv
    (models/attention/head_gate.py); works with every attention kind.
    dca_scaling*: DCA's length-dependent logit scaling (models/attention/dca/scaling.py).
    dca_cuda_graphs: DCA's passes replayed as CUDA graphs (models/attention/dca/graphs.py).
    recompute_keep_attention: under full recompute, each core attention keeps its output and LSE
    from the first forward instead of running again (models/recompute.py).
    """

    attention_kind: str = "standard"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = NO_SCALING  # context scaling of every RoPE (models/rope_scaling.py)
    dca_chunk_size: int = 8192
    dca_local_size: int = 1024
    dca_scaling: str = "none"
    dca_scaling_parts: str = "all"
    dca_scaling_attn_scale: float = 0.1
    dca_scaling_floor_scale: int = 8192
    dca_scaling_original_length: int | None = None
    dca_cuda_graphs: bool = False
    attention_chunk_size: int = 8192
    global_layer_interval: int = 0
    head_wise_attn_gate: bool = False
    head_wise_attn_gate_init_weight_scale: float = 0.1
    head_wise_attn_gate_init_bias: float = 2.0
    recompute_keep_attention: bool = False  # full recompute keeps core-attention results
    fused_rmsnorm: bool = False  # the layers' RMSNorms as one Triton pass (models/fused.py)

    def __post_init__(self) -> None:
        if self.head_wise_attn_gate:
            # Before megatron's own checks, so a TP size that only the gate rules out says so.
            self._validate_head_gate()
        super().__post_init__()
        if self.attention_kind not in ATTENTION_KINDS:
            raise ValueError(
                f"attention kind {self.attention_kind!r} is unknown; "
                f"choose one of {ATTENTION_KINDS}"
            )
        if self.fused_rmsnorm and self.normalization != "RMSNorm":
            raise ValueError(f"fused_rmsnorm needs normalization RMSNorm, not {self.normalization}")
        if self.recompute_keep_attention and self.recompute_granularity != "full":
            raise ValueError("recompute_keep_attention applies to full recompute only "
                             f"(recompute_granularity is {self.recompute_granularity!r})")
        if self.attention_kind == "dca":
            self._validate_dca()
        elif self.dca_scaling != "none":
            raise ValueError(f"dca_scaling ({self.dca_scaling!r}) applies to attention kind "
                             f"'dca', not {self.attention_kind!r}; set dca_scaling to 'none'")
        if self.attention_kind == "chunked":
            self._validate_chunked()

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

    def _validate_dca(self) -> None:
        if self.dca_chunk_size <= 0 or self.dca_local_size <= 0:
            raise ValueError(
                f"dca_chunk_size ({self.dca_chunk_size}) and dca_local_size "
                f"({self.dca_local_size}) must be positive"
            )
        if self.dca_chunk_size <= self.dca_local_size:
            raise ValueError(
                f"dca_chunk_size ({self.dca_chunk_size}) must exceed dca_local_size "
                f"({self.dca_local_size}); the chunk length is their difference"
            )
        if self.apply_rope_fusion:
            raise ValueError("apply_rope_fusion must be off with DCA: DCA applies its own RoPE")
        self.dca_scaling_config()  # its own checks name the bad setting

    def dca_scaling_config(self) -> DCAScaling:
        """The DCA scaling these settings describe."""
        return DCAScaling(self.dca_scaling, self.dca_scaling_parts, self.dca_scaling_attn_scale,
                          self.dca_scaling_floor_scale, self.dca_scaling_original_length)

    def _validate_chunked(self) -> None:
        if self.attention_chunk_size <= 0:
            raise ValueError(f"chunk_size ({self.attention_chunk_size}) must be positive")
        if self.global_layer_interval < 0:
            raise ValueError(
                f"global_layer_interval ({self.global_layer_interval}) must be >= 0 (0: no "
                "global layers)"
            )
