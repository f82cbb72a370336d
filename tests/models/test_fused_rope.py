"""Fused RoPE (models/fused_rope.py) against megatron's own unfused RoPE as the oracle: values
and gradients in float64, packed (THD) sequences, the fused QKV split against megatron's split
and RoPE, and a whole model switched to `apply_rope_fusion` (same state, same logits and
gradients). On CPU the kernels' torch fallback runs; tests/gpu/test_fused_rope_gpu.py runs the
Triton path."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import attention as megatron_attention

from models.fused_rope import (
    fused_apply_qkv_rotary_pos_emb,
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
)
from models.gpt import build_gpt, transformer_config
from models.options import BuildOptions
from models.schema import AttentionConfig, ModelConfig


def _freqs(seq: int, dim: int) -> torch.Tensor:
    """megatron's RotaryEmbedding table (its CPU-initialised frequencies, its layout): [seq, 1,
    1, dim] float32, the two halves repeating the angles."""
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=500000,
                           use_cpu_initialization=True)
    angles = rope.get_freqs_non_repeated(seq)  # [seq, dim / 2]
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _qkv_slice(s: int, b: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """q as megatron holds it: a strided view into a fused QKV projection."""
    qkv = torch.randn(s, b, h, 3 * d, dtype=dtype, generator=torch.Generator().manual_seed(0))
    return qkv[..., :d]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_megatrons_unfused_rope_and_its_gradient(dtype: torch.dtype) -> None:
    s, b, h, d = 300, 2, 3, 16
    freqs = _freqs(s, d)
    x = _qkv_slice(s, b, h, d, dtype)
    grad = torch.randn(s, b, h, d, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = fused_apply_rotary_pos_emb(ours, freqs)
    expected = rope_utils._apply_rotary_pos_emb_bshd(ref, freqs)
    # Both read float32 cos / sin tables (megatron's from its float32 angles): an ulp of a table
    # entry (torch's vectorised cos on another shape) is the only difference left.
    tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, expected, **tol)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(ours.grad, ref.grad, **tol)
    assert out.shape == x.shape and out.dtype == dtype


def test_backward_is_the_transpose_by_finite_differences() -> None:
    """<R x, g> = <x, R^T g> for the forward and backward as written (float64)."""
    s, b, h, d = 40, 1, 2, 8
    freqs = _freqs(s, d)
    x = torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: fused_apply_rotary_pos_emb(t, freqs), (x,))


def test_packed_sequences_restart_at_position_zero() -> None:
    h, d = 2, 8
    cu = torch.tensor([0, 5, 17, 40], dtype=torch.int32)
    freqs = _freqs(64, d)
    x = torch.randn(40, h, d, dtype=torch.float64, requires_grad=True)
    out = fused_apply_rotary_pos_emb_thd(x, cu, freqs)
    parts = [rope_utils._apply_rotary_pos_emb_bshd(x[a:e, None], freqs[:e - a])[:, 0]
             for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    torch.testing.assert_close(out, torch.cat(parts))
    torch.autograd.gradcheck(lambda t: fused_apply_rotary_pos_emb_thd(t, cu, freqs), (x,))


def test_refuses_tables_it_does_not_rotate_by() -> None:
    x = torch.randn(8, 1, 2, 16)
    with pytest.raises(ValueError, match="rotate-half"):
        fused_apply_rotary_pos_emb(x, _freqs(8, 16), interleaved=True)
    with pytest.raises(ValueError, match=r"\[s, 1, 1, 16\]"):
        fused_apply_rotary_pos_emb(x, _freqs(8, 8))  # rotary_percent < 1


def megatron_split(mixed: torch.Tensor, freqs: torch.Tensor,
                    split: list[int]) -> tuple[torch.Tensor, ...]:
    """megatron's unfused path: split the fused QKV, reshape the query heads out of their
    groups, rotate q and k."""
    q, k, v = torch.split(mixed, split, dim=3)
    q = q.reshape(q.shape[0], q.shape[1], -1, split[1])
    return (rope_utils._apply_rotary_pos_emb_bshd(q, freqs),
            rope_utils._apply_rotary_pos_emb_bshd(k, freqs), v)


@pytest.mark.parametrize("q_per_group", [1, 4])
def test_fused_qkv_split_matches_megatrons_split_and_rope(q_per_group: int) -> None:
    """q, k, v and the fused gradient, float64, MHA and GQA, batch 2; v is a view of the
    projection (no copy) and the gradient one tensor of its layout."""
    s, b, groups, d = 50, 2, 3, 16
    split = [q_per_group * d, d, d]
    freqs = _freqs(s, d)
    mixed = torch.randn(s, b, groups, sum(split), dtype=torch.float64,
                        generator=torch.Generator().manual_seed(0))
    grads = [torch.randn(s, b, groups * n, d, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(n)) for n in (q_per_group, 1, 1)]
    ours, ref = mixed.clone().requires_grad_(), mixed.clone().requires_grad_()
    out = fused_apply_qkv_rotary_pos_emb(ours, freqs, freqs, split)
    expected = megatron_split(ref, freqs, split)
    tol = dict(rtol=1e-6, atol=1e-6)  # float32 tables on both sides, as above
    for a, e in zip(out, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, **tol)
    assert out[2].data_ptr() == ours.data_ptr() + sum(split[:2]) * 8  # v: a view, not a copy
    torch.autograd.backward(out, grads)
    torch.autograd.backward(expected, grads)
    torch.testing.assert_close(ours.grad, ref.grad, **tol)


def test_fused_qkv_backward_is_the_transpose_by_finite_differences() -> None:
    # The whole Jacobian: 4 positions (each its own rotation) keep it at a third of 12's cost.
    s, b, groups, q_per_group, d = 4, 2, 2, 3, 8
    split = [q_per_group * d, d, d]
    freqs = _freqs(s, d)
    mixed = torch.randn(s, b, groups, sum(split), dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda t: fused_apply_qkv_rotary_pos_emb(t, freqs, freqs, split), (mixed,))


def test_fused_qkv_refuses_what_it_does_not_split() -> None:
    mixed = torch.randn(8, 1, 2, 6 * 16)
    with pytest.raises(ValueError, match="rotate-half"):
        fused_apply_qkv_rotary_pos_emb(mixed, _freqs(8, 16), _freqs(8, 16), [64, 16, 16],
                                       interleaved=True)
    with pytest.raises(ValueError, match="whole query heads"):
        fused_apply_qkv_rotary_pos_emb(mixed, _freqs(8, 16), _freqs(8, 16), [40, 16, 16])


@pytest.mark.parametrize("kind", ["standard", "chunked"])
def test_a_model_with_fused_rope_is_the_same_model(single_process, kind: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard attention rotates every layer: megatron takes the fused QKV split (one call a
    layer). Chunked attention's global layers skip RoPE, so megatron's split stays and each
    rotated layer's q and k take the fused RoPE."""
    model = ModelConfig(num_query_groups=2, rope_theta=500000.0)
    attention = AttentionConfig(kind=kind, chunk_size=16, global_layer_interval=2)
    plain_cfg = transformer_config(model, attention)
    fused_cfg = transformer_config(model, attention, options=BuildOptions(fused_rope=True))
    assert fused_cfg.apply_rope_fusion and not plain_cfg.apply_rope_fusion
    assert fused_cfg.fused_single_qkv_rope == (kind == "standard")
    assert rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb  # no TE here
    assert megatron_attention.apply_fused_qkv_rotary_pos_emb is fused_apply_qkv_rotary_pos_emb
    calls, qkv_calls = [], []
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb",
                        lambda *a, **k: calls.append(1) or fused_apply_rotary_pos_emb(*a, **k))
    monkeypatch.setattr(megatron_attention, "apply_fused_qkv_rotary_pos_emb",
                        lambda *a, **k: qkv_calls.append(1)
                        or fused_apply_qkv_rotary_pos_emb(*a, **k))
    plain, fused = build_gpt(plain_cfg, 256, 64), build_gpt(fused_cfg, 256, 64)
    assert_same_model(plain, fused, 64)
    if kind == "standard":  # both layers through the fused QKV split
        assert (len(qkv_calls), len(calls)) == (2, 0)
    else:  # layer 2 is global, without RoPE; layer 1's q and k through our kernel
        assert (len(qkv_calls), len(calls)) == (0, 2)


def assert_same_model(plain: torch.nn.Module, other: torch.nn.Module, seq: int) -> torch.Tensor:
    """`other` with `plain`'s state gives its logits and every gradient (2 sequences of `seq`
    tokens); returns the logits."""
    other.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).expand_as(tokens)
    logits = []
    for net in (plain, other):
        out = net(tokens, positions, None)
        out.float().pow(2).mean().backward()
        logits.append(out)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), other.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    return logits[0].detach()


def test_dca_keeps_its_own_rotation() -> None:
    """DCA rotates q and k in its own kernels: fused_rope leaves megatron's fusion off there
    (turning it on would be refused: models/config.py)."""
    config = transformer_config(ModelConfig(), AttentionConfig(kind="dca", dca_chunk_size=32,
                                                               dca_local_size=8),
                                options=BuildOptions(fused_rope=True))
    assert not config.apply_rope_fusion
