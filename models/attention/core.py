"""Thin megatron core-attention modules around the functional cores.

megatron's `SelfAttention` hands its core attention `[s, b, heads, dim]` tensors (or `[t, heads,
dim]` for packed THD sequences) that already carry RoPE, unless the layer skips RoPE (DCA applies
its own). Each module here converts to `[b, s, heads, dim]`, calls its functional core and returns
`[s, b, heads * dim]` as megatron expects.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.attention.causal import causal_attention


class CoreAttention(MegatronModule):
    """Base class: layout conversion and the megatron constructor signature."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: object = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("context parallelism is not supported by this attention yet")
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise ValueError("attention_dropout must be 0: the fused attention paths have no dropout")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """[b, s, hq, d], [b, s, hk, d], [b, s, hk, d] -> [b, s, hq, d]."""
        raise NotImplementedError

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: object = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by our core attentions")
        if packed_seq_params is not None:
            # THD: [t, h, d] -> [1, t, h, d]; megatron reshapes our [t, h*d] back to [t, 1, h*d].
            out = self.attend(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                              packed_seq_params.cu_seqlens_q)
            return out.squeeze(0).flatten(1)
        # [s, b, h, d] -> [b, s, h, d]: a view; the kernels pick their own strides.
        out = self.attend(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), None)
        return out.transpose(0, 1).flatten(2)  # [s, b, h * d]


class CausalCoreAttention(CoreAttention):
    """Standard causal attention (torch SDPA)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        return causal_attention(q, k, v, softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens)
