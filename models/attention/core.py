"""Thin megatron core-attention modules around the functional cores.

megatron's `SelfAttention` hands its core attention `[s, b, heads, dim]` tensors (or `[t, heads,
dim]` for packed THD sequences) that already carry RoPE, unless the layer skips RoPE (DCA applies
its own). Each module here converts to `[b, s, heads, dim]`, calls its functional core and returns
`[s, b, heads * dim]` as megatron expects.

With context parallelism (config.context_parallel_size > 1) each rank holds its tokens in the
load-balanced layout (models/attention/context_parallel.py) and `attend_cp` runs the variant's CP
form over megatron's CP group instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.attention.causal import causal_attention
from models.attention.cp_variants import cp_causal_attention
from models.attention.probe import active_probe, causal_probabilities, record
from models.recompute import AttentionKeeper
from models.rope_scaling import attention_factor


def _scaled_softmax_scale(config: TransformerConfig, layer_number: int,
                          softmax_scale: float | None) -> float | None:
    """RoPE scaling's attention factor a (YaRN) multiplies cos and sin of q and k, so it scales
    the logits of a layer with RoPE by a^2; folded into the softmax scale here (exact, as RoPE
    covers the whole head). DCA applies it in its own rotation and skips megatron's RoPE."""
    factor = attention_factor(getattr(config, "rope_scaling", None))
    skips_rope = bool(config.no_rope_freq and config.no_rope_freq[layer_number - 1])
    if factor == 1.0 or skips_rope:
        return softmax_scale
    base = config.kv_channels ** -0.5 if softmax_scale is None else softmax_scale
    return base * factor ** 2


class CoreAttention(MegatronModule):
    """Base class: layout conversion and the megatron constructor signature."""

    # Whether `attend` takes q [b, s, kv_heads, q_per_kv, d] too: the query heads in their
    # groups, views of megatron's fused projection (models/fused_qkv.py, models/spec.py)
    takes_grouped_query = False

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: object = None) -> None:
        super().__init__(config=config)
        self.cp_group: dist.ProcessGroup | None = None
        # whether the CP exchange runs behind the attention's compute (`parallel.cp_overlap`)
        self.cp_overlap = config.cp_overlap
        if config.context_parallel_size > 1:
            self.cp_group = (getattr(pg_collection, "cp", None)
                             or parallel_state.get_context_parallel_group())
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise ValueError(
                "attention_dropout must be 0: the fused attention paths have no dropout"
            )
        self.layer_number = layer_number
        self.softmax_scale = _scaled_softmax_scale(config, layer_number, softmax_scale)
        self.keeper = AttentionKeeper()  # full recompute that keeps (out, lse): models/recompute.py

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        keep = self.training and getattr(self.config, "recompute_keep_attention", False)
        with self.keeper.scope(keep):
            return super().__call__(*args, **kwargs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """[b, s, hq, d], [b, s, hk, d], [b, s, hk, d] -> [b, s, hq, d]."""
        raise NotImplementedError

    def attend_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Context-parallel form of `attend` over this rank's tokens, same shapes."""
        raise NotImplementedError(f"{type(self).__name__} does not support context parallelism")

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The attention probabilities [b, hq, n, s] of query `rows` (models/attention/probe.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no attention probe")

    def scale(self, q: torch.Tensor) -> float:
        return q.shape[-1] ** -0.5 if self.softmax_scale is None else float(self.softmax_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: object = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by our core attentions")
        if query.dim() == 5 and (self.cp_group is not None or packed_seq_params is not None
                                 or active_probe() is not None):
            query = query.flatten(2, 3)  # [s, b, heads, d]: only `attend` takes heads in groups
        if self.cp_group is not None:
            if packed_seq_params is not None:
                raise NotImplementedError(
                    "packed sequences (THD, cu_seqlens) are not supported with context "
                    "parallelism; use parallel.cp=1 or unpacked [s, b] batches")
            out = self.attend_cp(query.transpose(0, 1), key.transpose(0, 1),
                                 value.transpose(0, 1))
            return out.transpose(0, 1).flatten(2)  # [s, b, h * d]
        if packed_seq_params is not None:
            # THD: [t, h, d] -> [1, t, h, d]; megatron reshapes our [t, h*d] back to [t, 1, h*d].
            out = self.attend(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                              packed_seq_params.cu_seqlens_q)
            return out.squeeze(0).flatten(1)
        # [s, b, h, d] -> [b, s, h, d]: a view; the kernels pick their own strides.
        q, k = query.transpose(0, 1), key.transpose(0, 1)
        probe = active_probe()
        if probe is not None:
            rows = probe.rows.to(q.device)  # made on the CPU, before the model's device is known
            record(self.layer_number, self.probabilities(q, k, rows), rows)
        out = self.attend(q, k, value.transpose(0, 1), None)
        return out.transpose(0, 1).flatten(2)  # [s, b, h * d]


class CausalCoreAttention(CoreAttention):
    """Standard causal attention (torch SDPA)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return causal_attention(q, k, v, softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens)

    def attend_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_causal_attention(q, k, v, group=self.cp_group, softmax_scale=self.softmax_scale,
                                   overlap=self.cp_overlap)

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return causal_probabilities(q, k, rows, self.scale(q))
