"""Head-wise attention output gate: validation, init, semantics, oracle, TP=2, training."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import build_module

from models.attention.core import CausalCoreAttention
from models.attention.head_gate import HeadGatedSelfAttention, fused_init
from models.config import LongContextConfig
from models.flops import training_flops_per_sequence
from models.gpt import build_gpt, transformer_config
from models.options import BuildOptions
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from models.spec import layer_spec
from tests.conftest import compose_config, spawn

SEQ, BATCH, HIDDEN = 12, 2, 32


# ---- helpers (the resharding tests use them too) -----------------------------------------------

def attention_config(*, tp: int = 1, heads: int = 4, groups: int | None = 2, bias: bool = True,
                     hidden: int = HIDDEN, std: float = 0.2, **attention: Any) -> LongContextConfig:
    """A one-layer gated config; a large init std makes attention peaked, so mistakes show."""
    model = ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads,
                        num_query_groups=groups, qkv_bias=bias, init_std=std)
    return transformer_config(model, AttentionConfig(head_wise_attn_gate=True, **attention),
                              ParallelConfig(tp=tp))


def build_attention(config: LongContextConfig) -> SelfAttention:
    """The self-attention module our layer spec builds for `config`."""
    spec = layer_spec(config, CausalCoreAttention).submodules.self_attention
    return build_module(spec, config=config, layer_number=1)


def without_gate(config: LongContextConfig) -> LongContextConfig:
    """The same megatron config with the head gate off."""
    return replace(config, attention=replace(config.attention, head_wise_attn_gate=False))


def without_gate_rows(state: dict[str, Any], rows: int) -> dict[str, Any]:
    """A gated (TP=1) state dict with the gate rows of every linear_qkv dropped."""
    return {name: t[:-rows] if name.endswith(("linear_qkv.weight", "linear_qkv.bias"))
            and t is not None else t for name, t in state.items()}


def ungated_copy(gated: HeadGatedSelfAttention) -> SelfAttention:
    """megatron's SelfAttention with the gated module's weights minus the gate rows."""
    plain = build_attention(without_gate(gated.config))
    plain.load_state_dict(without_gate_rows(gated.state_dict(), gated.gate_rows))
    return plain


def set_gate(att: HeadGatedSelfAttention, weight: float, bias: torch.Tensor | float) -> None:
    """Set this rank's gate rows (the trailing rows of the local linear_qkv)."""
    with torch.no_grad():
        att.linear_qkv.weight[-att.gate_rows:] = weight
        if att.linear_qkv.bias is not None:
            att.linear_qkv.bias[-att.gate_rows:] = bias


def hidden_states(seed: int = 0) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ---- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (dict(attention_output_gate=True), "attention_output_gate"),
    (dict(num_attention_heads=6, num_query_groups=6, tensor_model_parallel_size=4),
     r"num_attention_heads \(6\) divisible by the TP size \(4\).*parallel.tp"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4),
     r"num_query_groups \(2\) >= the TP size \(4\).*model.num_query_groups"),
])
def test_invalid_gate_settings_fail_with_the_fix(change: dict, message: str) -> None:
    config = attention_config(heads=8, groups=4, hidden=64)
    with pytest.raises(ValueError, match=message):
        replace(config, **change)


def test_head_gate_option_composes_with_every_attention_kind() -> None:
    assert compose_config(["+attention=head_gate"]).attention.head_wise_attn_gate
    for kind in ("dca", "chunked"):
        attention = compose_config([f"+attention=[{kind},head_gate]"]).attention
        assert attention.kind == kind and attention.head_wise_attn_gate


# ---- init and shapes ---------------------------------------------------------------------------

def test_gate_rows_start_small_with_bias_two_and_the_ungated_qkv_rows(single_process) -> None:
    config = attention_config(heads=8, groups=4, hidden=128, std=0.02)
    torch.manual_seed(3)
    gated = build_attention(config)
    torch.manual_seed(3)
    plain = build_attention(without_gate(config))
    weight, bias = gated.linear_qkv.weight, gated.linear_qkv.bias
    assert weight.shape == (plain.linear_qkv.weight.shape[0] + 8, 128)
    # The QKV rows are drawn first, exactly as the ungated model draws them.
    torch.testing.assert_close(weight[:-8], plain.linear_qkv.weight, rtol=0, atol=0)
    assert 0.09 < weight[-8:].std().item() / weight[:-8].std().item() < 0.11
    assert torch.equal(bias[-8:], torch.full((8,), 2.0)) and not bias[:-8].any()

    no_bias = build_attention(attention_config(bias=False, head_wise_attn_gate_init_weight_scale=0))
    assert no_bias.linear_qkv.bias is None and not no_bias.linear_qkv.weight[-4:].any()


def test_fused_init_draws_the_global_qkv_rows_then_the_global_gate_rows() -> None:
    # The CPU initialisation hands the whole fused weight (both ranks' blocks at TP=2).
    torch.manual_seed(0)
    weight = torch.empty(2 * (6 + 2), 3)
    fused_init(torch.nn.init.normal_, qkv_rows=6, gate_rows=2, scale=0.5)(weight)
    torch.manual_seed(0)
    qkv, gate = torch.nn.init.normal_(torch.empty(12, 3)), torch.nn.init.normal_(torch.empty(4, 3))
    blocks = weight.view(2, 8, 3)  # rank r: [qkv chunk r; gate chunk r]
    assert torch.equal(blocks[:, :6].flatten(0, 1), qkv)
    assert torch.equal(blocks[:, 6:].flatten(0, 1), gate * 0.5)


@pytest.mark.parametrize("kind, options", [
    ("standard", []),
    ("dca", ["attention.dca_chunk_size=16", "attention.dca_local_size=4"]),
    ("chunked", ["attention.chunk_size=16", "attention.global_layer_interval=2"]),
])
def test_saturated_gate_reproduces_the_ungated_model_with_every_core(
        single_process, kind: str, options: list[str]) -> None:
    cfg = compose_config([f"+attention=[{kind},head_gate]", "model.qkv_bias=true",
                          "model.init_std=0.2"] + options)
    config = transformer_config(cfg.model, cfg.attention)
    gated = build_gpt(config, 256, 48).eval()
    plain = build_gpt(without_gate(config), 256, 48).eval()
    plain.load_state_dict(without_gate_rows(gated.state_dict(), config.num_attention_heads))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48).expand_as(tokens)
    with torch.no_grad():
        expected = plain(tokens, positions, None)
        initial = gated(tokens, positions, None)
        for layer in gated.decoder.layers:
            set_gate(layer.self_attention, 0.0, 1e4)  # sigmoid(1e4) == 1 in float32
        saturated = gated(tokens, positions, None)
    assert saturated.shape == (2, 48, 256)
    torch.testing.assert_close(saturated, expected, rtol=1e-5, atol=1e-5)
    assert (initial - expected).abs().max() > 1e-2  # the gate at init does act


# ---- semantics ---------------------------------------------------------------------------------

def test_zero_gate_halves_every_head(single_process) -> None:
    gated = build_attention(attention_config())
    set_gate(gated, 0.0, 0.0)
    plain = ungated_copy(gated)
    x = hidden_states()
    with torch.no_grad():
        torch.testing.assert_close(gated(x, None)[0], 0.5 * plain(x, None)[0],
                                   rtol=1e-6, atol=1e-6)


def elementwise_gate_layout(t: torch.Tensor, heads: int, groups: int, hn: int) -> torch.Tensor:
    """Our [QKV; Gate] rows -> megatron's attention_output_gate rows: [q, gate, k, v] per query
    group, each head's gate row repeated over the head dimension."""
    qkv, gate = t[:-heads], t[-heads:]
    per_group = heads // groups * hn
    qkv = qkv.unflatten(0, (groups, per_group + 2 * hn))  # [ng, (np/ng + 2) * hn, ...]
    gate = gate.repeat_interleave(hn, dim=0).unflatten(0, (groups, per_group))
    return torch.cat([qkv[:, :per_group], gate, qkv[:, per_group:]], dim=1).flatten(0, 1)


def test_matches_megatron_elementwise_gate_with_repeated_rows_forward_and_backward(
        single_process) -> None:
    config = attention_config(heads=4, groups=2)
    gated = build_attention(config)
    with torch.no_grad():  # a gate that varies per token and head
        gated.linear_qkv.weight[-4:].normal_(0, 0.5)
        gated.linear_qkv.bias[-4:].normal_(0, 1)
    oracle = build_attention(replace(without_gate(config), attention_output_gate=True))
    hn = config.kv_channels
    state = gated.state_dict()
    for name in ("linear_qkv.weight", "linear_qkv.bias"):
        state[name] = elementwise_gate_layout(state[name], 4, 2, hn)
    oracle.load_state_dict(state)

    x = hidden_states()
    probe = hidden_states(seed=5)
    out = gated(x, None)[0]
    with torch.compiler.set_stance("force_eager"):  # megatron's gate: its math, not a compile
        oracle_out = oracle(x, None)[0]
    torch.testing.assert_close(out, oracle_out, rtol=1e-5, atol=1e-6)
    (out * probe).sum().backward()
    (oracle_out * probe).sum().backward()

    # The gate receives gradients: the oracle's summed over each head's repeated rows.
    for name in ("weight", "bias"):
        grad = getattr(gated.linear_qkv, name).grad
        oracle_grad = getattr(oracle.linear_qkv, name).grad.unflatten(0, (2, 6 * hn))
        q, gate, kv = oracle_grad.split([2 * hn, 2 * hn, 2 * hn], dim=1)  # per query group
        assert grad[-4:].abs().min() > 0
        torch.testing.assert_close(grad[-4:], gate.flatten(0, 1).unflatten(0, (4, hn)).sum(1),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad[:-4], torch.cat([q, kv], dim=1).flatten(0, 1),
                                   rtol=1e-5, atol=1e-6)


def reference_attention(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor,
                        w_proj: torch.Tensor, keep: torch.Tensor, groups: int) -> torch.Tensor:
    """Causal attention in plain torch from global weights (megatron's [q, k, v] per query group
    layout), head h's output scaled by keep[h] before the output projection."""
    heads, hn = keep.numel(), w_proj.shape[1] // keep.numel()
    mixed = (x @ w_qkv.T + b_qkv).unflatten(-1, (groups, -1))  # [s, b, ng, (np/ng + 2) * hn]
    q, k, v = mixed.split([heads // groups * hn, hn, hn], dim=-1)
    q = q.unflatten(-1, (-1, hn)).flatten(2, 3)  # [s, b, np, hn]
    k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                         is_causal=True)  # [b, np, s, hn]
    out = out * keep[:, None, None]
    return out.permute(2, 0, 1, 3).flatten(2) @ w_proj.T  # [s, b, h]


def _saturated_heads_at_tp2() -> None:
    heads, groups, hn = 4, 2, HIDDEN // 4
    rank = parallel_state.get_tensor_model_parallel_rank()
    gated = build_attention(attention_config(tp=2, heads=heads, groups=groups))
    g = torch.Generator().manual_seed(0)  # the same global weights on both ranks
    w_qkv = torch.randn((heads + 2 * groups) * hn, HIDDEN, generator=g) * 0.3
    b_qkv = torch.randn((heads + 2 * groups) * hn, generator=g) * 3  # far from +-1e4
    w_proj = torch.randn(HIDDEN, heads * hn, generator=g) * 0.3
    keep = torch.tensor([1.0, 0.0, 0.0, 1.0])  # pass heads 0 and 3, zero heads 1 and 2
    gate_bias = torch.where(keep > 0, 1e4, -1e4)
    # Rank r holds [QKV chunk r; gate chunk r] (linear_qkv) and column chunk r of linear_proj.
    with torch.no_grad():
        gated.linear_qkv.weight.copy_(torch.cat([w_qkv.chunk(2)[rank],
                                                 torch.zeros(heads // 2, HIDDEN)]))
        gated.linear_qkv.bias.copy_(torch.cat([b_qkv.chunk(2)[rank], gate_bias.chunk(2)[rank]]))
        gated.linear_proj.weight.copy_(w_proj.chunk(2, dim=1)[rank])

    seen: dict[str, torch.Tensor] = {}
    gated.core_attention.register_forward_hook(lambda m, a, out: seen.update(core=out))
    gated.linear_proj.register_forward_pre_hook(lambda m, a: seen.update(gated=a[0]))
    x = hidden_states()
    with torch.no_grad():
        out = gated(x, None)[0]
    # Each head is passed or zeroed exactly, then the whole layer is the reference's.
    core, passed = (seen[k].unflatten(-1, (heads // 2, hn)) for k in ("core", "gated"))
    for local, h in enumerate(range(rank * heads // 2, (rank + 1) * heads // 2)):
        expected = core[:, :, local] if keep[h] else torch.zeros_like(core[:, :, local])
        assert torch.equal(passed[:, :, local], expected), f"head {h} on rank {rank}"
    expected_out = reference_attention(x, w_qkv, b_qkv, w_proj, keep, groups)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_saturated_per_head_biases_pass_or_zero_exactly_their_heads_at_tp2() -> None:
    spawn(_saturated_heads_at_tp2, world=2, tp=2)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_gives_the_same_gradients(single_process, recompute: str) -> None:
    # The gate is held from linear_qkv to linear_proj: a recomputed forward must use its own.
    model = ModelConfig(qkv_bias=True, init_std=0.2)
    grads = []
    for mode in ("none", recompute):
        config = transformer_config(model, AttentionConfig(head_wise_attn_gate=True),
                                    options=BuildOptions(recompute=mode))
        torch.manual_seed(0)
        gpt = build_gpt(config, 256, SEQ).train()
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        gpt(tokens, torch.arange(SEQ).expand_as(tokens), None).square().mean().backward()
        grads.append({n: p.grad for n, p in gpt.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


# ---- training ----------------------------------------------------------------------------------

def test_training_with_the_gate_reduces_loss(run_training) -> None:
    rows = run_training(["+attention=head_gate", "trainer.max_steps=20", "trainer.save_interval=0"])
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def test_flops_count_the_gate_rows_of_linear_qkv(single_process) -> None:
    model = ModelConfig()

    def qkv_weights(gate: bool) -> int:
        config = transformer_config(model, AttentionConfig(head_wise_attn_gate=gate))
        gpt = build_gpt(config, 256, 64)
        return sum(p.numel() for n, p in gpt.named_parameters() if n.endswith("linear_qkv.weight"))

    sizes = dict(num_layers=model.num_layers, hidden_size=model.hidden_size,
                 num_attention_heads=model.num_attention_heads,
                 num_query_groups=model.num_attention_heads,
                 kv_channels=model.hidden_size // model.num_attention_heads,
                 ffn_hidden_size=256, swiglu=True, vocab_size=256, seq_length=64)
    extra_flops = (training_flops_per_sequence(**sizes, head_wise_gate=True)
                   - training_flops_per_sequence(**sizes))
    # 6 FLOPs per weight and token (forward 2, backward 4).
    assert extra_flops == 6 * 64 * (qkv_weights(True) - qkv_weights(False))
