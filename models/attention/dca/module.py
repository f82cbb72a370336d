"""megatron core-attention module for Dual Chunk Attention.

The layer skips megatron's RoPE for DCA (`no_rope_freq`, from the variant's `own_rope` in
models/attention/registry.py) because DCA rotates each query three times with its own per-part
positions; q and k arrive unrotated and `dual_chunk_attention` applies RoPE itself, computing
cos/sin for the positions it needs (up to chunk_size itself: the "table" always has its C + 1
rows). Frequencies and the attention factor
(YaRN's mscale) follow the model's RoPE scaling (models/rope_scaling.py). The optional
length-dependent logit scaling (`dca_scaling`) comes from the attention config.
"""

from __future__ import annotations

import torch

from models.attention.core import CoreAttention
from models.attention.cp_variants import cp_dual_chunk_attention
from models.attention.dca import dispatch
from models.attention.dca.attention import dual_chunk_attention
from models.attention.probe import dca_probabilities
from models.attention.registry import dca_scaling
from models.rope_scaling import attention_factor


class DCACoreAttention(CoreAttention):
    """Dual Chunk Attention over unrotated q/k (see models/attention/dca/attention.py)."""

    takes_grouped_query = True  # its kernels read q where megatron's projection left it

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.chunk_size = config.attention.dca_chunk_size
        self.local_size = config.attention.dca_local_size
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.mscale = attention_factor(config.rope_scaling)
        self.scaling = dca_scaling(config.attention)
        self.cuda_graphs = config.dca_cuda_graphs
        # how DCA runs, from the run's options (models.options.BuildOptions), as a plain string
        self.backward = str(config.dca_backward)
        self.keep_rotated = config.dca_keep_rotated
        # each batch row's own prompt length while a padded batch of prompts is prefilled
        # (set by the decoding engine, trainer/engine/cache.py): a length-dependent scaling's
        # factors follow it; None: every row is `seq` tokens long
        self.row_lengths: tuple[int, ...] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return dual_chunk_attention(
            q, k, v, chunk_size=self.chunk_size, local_size=self.local_size,
            rope_theta=self.rope_theta, mscale=self.mscale, softmax_scale=self.softmax_scale,
            cu_seqlens=cu_seqlens, scaling=self.scaling, rope_scaling=self.rope_scaling,
            cuda_graphs=self.cuda_graphs, backward=self.backward,
            keep_rotated=self.keep_rotated, lengths=self.row_lengths,
        )

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return dca_probabilities(
            q, k, rows, self.scale(q), chunk_size=self.chunk_size, local_size=self.local_size,
            rope_theta=self.rope_theta, mscale=self.mscale, scaling=self.scaling,
            rope_scaling=self.rope_scaling,
        )

    def attend_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dispatch.route_cp()
        return cp_dual_chunk_attention(
            q, k, v, chunk_size=self.chunk_size, local_size=self.local_size, group=self.cp_group,
            rope_theta=self.rope_theta, mscale=self.mscale, softmax_scale=self.softmax_scale,
            scaling=self.scaling, rope_scaling=self.rope_scaling, overlap=self.cp_overlap,
        )
