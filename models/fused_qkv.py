"""Megatron's fused QKV projection handed to DCA with its query heads in their groups.

megatron's projection output is [s, b, groups, (q_per_group + 2) * d]: a group's query heads, then
its key and value. Its split reshapes the query heads to [s, b, heads, d], which that layout cannot
view (the head strides differ within and across groups), so the forward copies q; its backward
concatenates dq, dk and dv into the fused gradient. Standard layers avoid both through megatron's
fused QKV RoPE (models/fused_rope.py). DCA rotates q itself, and its kernel path reads q only in its
rotation passes, which take heads in groups. So for DCA layers `GroupedQuerySelfAttention` hands the
core q as a view [s, b, groups, q_per_group, d] (`split_grouped`), and DCA's backward writes dq, dk
and dv into one tensor of the projection's layout (`gradient_slots`), which the split's backward
returns as the fused gradient as it is. Where either side cannot (another path of DCA's, a gradient
summed from several uses), the split's backward assembles the gradient itself.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp


def qkv_slots(fused: torch.Tensor, q_per_group: int) -> tuple[torch.Tensor, ...]:
    """Views of the fused QKV [s, b, groups, (q_per_group + 2) * d]: q [s, b, groups,
    q_per_group, d], k and v [s, b, groups, d]."""
    head_dim = fused.shape[-1] // (q_per_group + 2)
    q_width = q_per_group * head_dim
    return (fused[..., :q_width].unflatten(-1, (q_per_group, head_dim)),
            fused[..., q_width:q_width + head_dim], fused[..., q_width + head_dim:])


def _shared_base(*views: torch.Tensor) -> torch.Tensor | None:
    """The contiguous tensor all `views` are views of, or None."""
    base = views[0]._base
    if base is None or any(v._base is not base for v in views) or not base.is_contiguous():
        return None
    return base


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class _GroupedSplit(torch.autograd.Function):
    """The fused QKV -> views (q in its groups, k, v); the backward returns the fused gradient
    without a copy where the three gradients are the slots of one tensor of its layout."""

    @staticmethod
    def forward(ctx: Any, fused: torch.Tensor,
                q_per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.layout = fused.shape, fused.dtype, q_per_group
        return qkv_slots(fused, q_per_group)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        shape, dtype, q_per_group = ctx.layout
        base = _shared_base(dq, dk, dv)
        if base is not None and base.dtype == dtype and base.numel() == shape.numel():
            fused = base.view(shape)
            if all(_same_view(g, slot) for g, slot in zip((dq, dk, dv),
                                                          qkv_slots(fused, q_per_group))):
                return fused, None
        fused = torch.empty(shape, dtype=dtype, device=dq.device)
        for g, slot in zip((dq, dk, dv), qkv_slots(fused, q_per_group)):
            slot.copy_(g)
        return fused, None


def split_grouped(fused: torch.Tensor,
                  q_per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused QKV [s, b, groups, (q_per_group + 2) * d] as views: q [s, b, groups,
    q_per_group, d] (its heads in their groups), k and v [s, b, groups, d]."""
    return _GroupedSplit.apply(fused, q_per_group)


def gradient_slots(q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Empty gradients for q, k and v (views of one contiguous tensor, as `split_grouped`
    makes them) laid out in one new tensor as they lie in theirs, so that the split's backward
    takes it whole; None where they are not such views."""
    base = _shared_base(q, k, v)
    if base is None:
        return None
    grad = torch.empty_like(base)
    return tuple(grad.as_strided(x.shape, x.stride(),
                                 x.storage_offset() - base.storage_offset())
                 for x in (q, k, v))


class GroupedQuerySelfAttention(SelfAttention):
    """megatron's SelfAttention that hands its core the query heads in their groups (views of
    the fused projection, `split_grouped`) while training, for cores that take them (DCA's:
    `takes_grouped_query`). Elsewhere (evaluation, generation, layouts megatron gathers across
    tensor-parallel ranks, q/k norms, an output gate) megatron's own split."""

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor,
                                    key_value_states: torch.Tensor | None = None,
                                    output_gate: bool = False,
                                    split_qkv: bool = True) -> Any:
        grouped = (split_qkv and not output_gate and key_value_states is None and self.training
                   and self.config.num_query_groups >= self.world_size
                   and not self.config.test_mode
                   and all(norm is None or isinstance(norm, IdentityOp)
                           for norm in (self.q_layernorm, self.k_layernorm)))
        if not grouped:
            return super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                       output_gate=output_gate,
                                                       split_qkv=split_qkv)
        fused, _ = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
        return split_grouped(fused, self.num_attention_heads_per_partition
                             // self.num_query_groups_per_partition)
