"""models/fused_qkv.py: megatron's fused QKV split into views with the query heads in their
groups, its backward (the fused gradient taken whole from one tensor of its layout, or
assembled), and a DCA model whose layers hand DCA those views, against megatron's own split."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from models import spec
from models.fused_qkv import GroupedQuerySelfAttention, gradient_slots, split_grouped
from models.gpt import build_gpt, transformer_config
from models.schema import AttentionConfig, ModelConfig
from tests.models.test_fused_rope import assert_same_model


def _megatron_split(fused: torch.Tensor, q_per_group: int) -> tuple[torch.Tensor, ...]:
    """megatron's split: q reshaped out of its groups (a copy), k and v views."""
    d = fused.shape[-1] // (q_per_group + 2)
    q, k, v = torch.split(fused, [q_per_group * d, d, d], dim=3)
    return q.reshape(*q.shape[:2], -1, d), k, v


@pytest.mark.parametrize("q_per_group", [1, 3])
def test_views_and_an_assembled_gradient_match_megatrons_split(q_per_group: int) -> None:
    s, b, groups, d = 5, 2, 2, 4
    fused = torch.randn(s, b, groups, (q_per_group + 2) * d, dtype=torch.float64,
                        requires_grad=True)
    q, k, v = split_grouped(fused, q_per_group)
    ref = _megatron_split(fused, q_per_group)
    assert q.shape == (s, b, groups, q_per_group, d) and q._base is not None
    torch.testing.assert_close(q.flatten(2, 3), ref[0], rtol=0, atol=0)
    torch.testing.assert_close((k, v), ref[1:], rtol=0, atol=0)
    weights = [torch.randn_like(x) for x in ref]
    (grad,) = torch.autograd.grad(
        sum((x.flatten(2, 3) if x.dim() == 5 else x).mul(w).sum()
            for x, w in zip((q, k, v), weights)), fused)
    (expected,) = torch.autograd.grad(sum(x.mul(w).sum() for x, w in zip(ref, weights)), fused)
    assert grad._base is None  # not slots of one tensor: assembled
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


class _WritesSlots(torch.autograd.Function):
    """A core that writes its gradients into `gradient_slots`, as DCA's kernel path does."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(q, k, v)
        return q.sum(3) * k + v

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        q, k, v = ctx.saved_tensors
        dq, dk, dv = gradient_slots(q, k, v)
        dq.copy_((grad * k)[..., None, :].expand_as(dq))
        dk.copy_(grad * q.sum(3))
        dv.copy_(grad)
        return dq, dk, dv


def test_a_gradient_in_slots_is_taken_whole() -> None:
    """The core's three gradients, written into slots of one tensor laid out as the
    projection, reach the projection as that tensor (no copy), and are right."""
    s, b, groups, g, d = 6, 1, 2, 3, 4
    weight = torch.randn(8, groups * (g + 2) * d, dtype=torch.float64, requires_grad=True)
    x = torch.randn(s, b, 8, dtype=torch.float64)
    fused = (x @ weight).view(s, b, groups, (g + 2) * d)
    seen = []
    fused.register_hook(seen.append)
    q, k, v = split_grouped(fused, g)
    out = _WritesSlots.apply(*(t.transpose(0, 1) for t in (q, k, v)))  # as the core sees them
    (grad,) = torch.autograd.grad(out.pow(2).sum(), weight)
    assert seen[0]._base is not None  # a view of the slots' tensor, not an assembled copy
    ref = _megatron_split((x @ weight).view(s, b, groups, (g + 2) * d), g)
    rq = ref[0].unflatten(2, (groups, g))
    (expected,) = torch.autograd.grad((rq.sum(3) * ref[1] + ref[2]).pow(2).sum(), weight)
    torch.testing.assert_close(grad, expected)
    assert gradient_slots(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)) is None


def test_a_dca_model_with_grouped_queries_is_the_same_model(
        single_process, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCA layers get GroupedQuerySelfAttention (GQA, 2 groups of 2): the same logits and
    gradients as with megatron's SelfAttention and its split; evaluation takes megatron's."""
    model = ModelConfig(num_query_groups=2)
    attention = AttentionConfig(kind="dca", dca_chunk_size=32, dca_local_size=8)
    config = transformer_config(model, attention)
    grouped = build_gpt(config, 256, 96)
    assert all(isinstance(layer.self_attention, GroupedQuerySelfAttention)
               for layer in grouped.decoder.layers)
    monkeypatch.setattr(spec, "GroupedQuerySelfAttention", SelfAttention)
    plain = build_gpt(config, 256, 96)
    logits = assert_same_model(plain, grouped, 96)
    grouped.eval()
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(grouped(tokens, torch.arange(96).expand_as(tokens), None),
                                   logits, rtol=1e-5, atol=1e-5)
