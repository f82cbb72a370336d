"""megatron core-attention module for chunked (Llama 4 style) attention.

Chunked layers receive q/k already rotated by megatron's RoPE; the interleaved global layers
(every `global_layer_interval`-th) use the standard causal module and skip RoPE
(`no_rope_freq`), both chosen per layer in models/spec.py (models/attention/registry.py).
"""

from __future__ import annotations

import torch

from models.attention.chunked import chunked_attention
from models.attention.core import CoreAttention
from models.attention.cp_variants import cp_chunked_attention
from models.attention.probe import chunked_probabilities


class ChunkedCoreAttention(CoreAttention):
    """Causal attention within chunks of `attention.chunk_size` tokens."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.chunk_size = config.attention.chunk_size

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return chunked_attention(q, k, v, chunk_size=self.chunk_size,
                                 softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens)

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return chunked_probabilities(q, k, rows, self.scale(q), self.chunk_size)

    def attend_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_chunked_attention(q, k, v, chunk_size=self.chunk_size, group=self.cp_group,
                                    softmax_scale=self.softmax_scale, overlap=self.cp_overlap)
