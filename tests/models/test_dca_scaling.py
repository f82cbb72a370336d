"""DCA with length-dependent logit scaling (Llama 4's log scaling, Qwen2.5-1M's YaRN temperature)
against the dense float64 reference with an explicit per-(query, key) logit factor.

The factors are written here from the sources' formulas with `math`, per token, independently of
models.attention.dca.scaling; the defaults are checked against transformers' Llama 4 config.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import Llama4TextConfig

from models.attention.cp_variants import cp_dual_chunk_attention
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.module import DCACoreAttention
from models.attention.dca.scaling import DCAScaling, token_factors
from models.gpt import build_gpt, transformer_config
from models.schema import AttentionConfig, ModelConfig
from tests.conftest import spawn
from tests.models.test_dca import dca_reference, grads, make_qkv, rel_err

PARTS = {"all": (0, 1, 2), "succ_inter": (1, 2), "inter": (2,)}


def log_factor(p: int, attn_scale: float, floor_scale: int) -> float:
    """Llama 4 (transformers Llama4TextAttention): 1 + attn_scale * log1p(floor((p+1) / floor))."""
    return 1 + attn_scale * math.log(math.floor((p + 1) / floor_scale) + 1)


def yarn_factor(n: int, attn_scale: float, original: int) -> float:
    """Qwen2.5-1M via vLLM: keys and softmax scale each times max(1, 0.1 ln(n / orig) + 1)."""
    m = max(1.0, attn_scale * math.log(n / original) + 1)
    return m * m


def part_factors(per_token: list[float], parts: str) -> torch.Tensor:
    """[s, 3]: the token's factor on the scaled parts, 1 elsewhere."""
    return torch.tensor([[f if part in PARTS[parts] else 1.0 for part in range(3)]
                         for f in per_token], dtype=torch.float64)


def check(scaling: DCAScaling, factors: torch.Tensor, seq: int, chunk: int, local: int,
          cu: torch.Tensor | None = None, hq: int = 4, hk: int = 2) -> None:
    q, k, v = make_qkv(1, seq, hq, hk, 8)
    ours = dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local, cu_seqlens=cu,
                                scaling=scaling)
    ref = dca_reference(q, k, v, chunk, local, cu_seqlens=cu, part_factors=factors)
    plain = dca_reference(q, k, v, chunk, local, cu_seqlens=cu)
    assert rel_err(plain, ref) > 1e-3  # the scaling does change the result
    assert rel_err(ours, ref) < 1e-10
    for g_ours, g_ref in zip(grads(ours, [q, k, v]), grads(ref, [q, k, v])):
        assert rel_err(g_ours, g_ref) < 1e-10


@pytest.mark.parametrize("parts", ["all", "succ_inter", "inter"])
def test_log_scaling_matches_reference(parts: str) -> None:
    seq, chunk, local = 45, 11, 3  # L = 8: 5 chunks and a tail
    scaling = DCAScaling("log", parts, attn_scale=0.3, floor_scale=6)
    factors = part_factors([log_factor(p, 0.3, 6) for p in range(seq)], parts)
    check(scaling, factors, seq, chunk, local)


@pytest.mark.parametrize("parts", ["all", "inter"])
def test_yarn_scaling_matches_reference(parts: str) -> None:
    seq, chunk, local = 40, 10, 3
    scaling = DCAScaling("yarn", parts, original_length=10)
    factors = part_factors([yarn_factor(seq, 0.1, 10)] * seq, parts)
    check(scaling, factors, seq, chunk, local, hq=6, hk=2)


def test_yarn_original_length_defaults_to_chunk_size() -> None:
    seq, chunk, local = 36, 9, 2
    factors = part_factors([yarn_factor(seq, 0.1, chunk)] * seq, "all")
    check(DCAScaling("yarn"), factors, seq, chunk, local)


def test_packed_documents_scale_by_their_own_position_and_length() -> None:
    cu = torch.tensor([0, 5, 30, 31, 52], dtype=torch.int32)
    lengths = [5, 25, 1, 21]
    in_doc = [p for n in lengths for p in range(n)]
    check(DCAScaling("log", "succ_inter", attn_scale=0.5, floor_scale=4),
          part_factors([log_factor(p, 0.5, 4) for p in in_doc], "succ_inter"), 52, 10, 3, cu)
    check(DCAScaling("yarn", original_length=7),
          part_factors([yarn_factor(n, 0.1, 7) for n in lengths for _ in range(n)], "all"),
          52, 10, 3, cu)


def test_padded_rows_scale_by_their_own_length() -> None:
    """`lengths` (the engine's prefill of prompts padded to one width): each row's queries take
    the yarn factor of its own length, as the float64 reference of that row alone does; the
    first piece of a longer prompt (its length past seq) takes the whole prompt's."""
    seq, chunk, local = 40, 10, 3
    scaling = DCAScaling("yarn", original_length=10)
    q, k, v = (t.detach() for t in make_qkv(3, seq, 4, 2, 8))
    lengths = [40, 23, 60]  # the last: the first 40 tokens of a prompt of 60
    args = {"chunk_size": chunk, "local_size": local, "scaling": scaling}
    ours = dual_chunk_attention(q, k, v, lengths=lengths, **args)
    for b, n in enumerate(lengths):
        rows = min(n, seq)
        ref = dca_reference(q[b:b + 1, :rows], k[b:b + 1, :rows], v[b:b + 1, :rows], chunk,
                            local, part_factors=part_factors([yarn_factor(n, 0.1, 10)] * rows,
                                                             "all"))
        assert rel_err(ours[b:b + 1, :rows], ref) < 1e-10
    shared = dual_chunk_attention(q, k, v, **args)  # every row taken as seq tokens long
    assert rel_err(shared[1:2, :23], ours[1:2, :23]) > 1e-3  # a row's own length matters


def test_row_lengths_are_refused_where_they_cannot_hold() -> None:
    q, k, v = make_qkv(2, 20, 2, 2, 8)  # with gradients
    args = {"chunk_size": 10, "local_size": 3, "scaling": DCAScaling("yarn")}
    with pytest.raises(ValueError, match="for inference"):
        dual_chunk_attention(q, k, v, lengths=[20, 5], **args)
    with torch.no_grad():
        with pytest.raises(ValueError, match="one positive length per batch row"):
            dual_chunk_attention(q, k, v, lengths=[20], **args)
        with pytest.raises(ValueError, match="cu_seqlens"):
            dual_chunk_attention(q[:1], k[:1], v[:1], lengths=[20], cu_seqlens=[0, 20], **args)


@pytest.mark.parametrize("parts", ["all", "succ_inter", "inter"])
def test_token_factors_follow_the_sources_formulas(parts: str) -> None:
    """The per-token factors a decode step computes on the device, at any position and length
    (a prompt's tokens at its length, a generated token at its position + 1)."""
    pos = torch.tensor([0, 3, 4, 11, 40, 100])
    lengths = torch.tensor([50, 50, 50, 50, 50, 101])
    got = token_factors(DCAScaling("log", parts, attn_scale=0.5, floor_scale=4), 9, pos, lengths)
    assert got.dtype == torch.float32 and got.shape == (6, 3)
    torch.testing.assert_close(got.double(), part_factors(
        [log_factor(p, 0.5, 4) for p in pos.tolist()], parts), rtol=1e-7, atol=0)
    got = token_factors(DCAScaling("yarn", parts, original_length=7), 9, pos, lengths)
    torch.testing.assert_close(got.double(), part_factors(
        [yarn_factor(n, 0.1, 7) for n in lengths.tolist()], parts), rtol=1e-7, atol=0)


def test_gradcheck_scaled() -> None:
    q, k, v = make_qkv(1, 14, 2, 1, 4, seed=3)
    scaling = DCAScaling("log", "succ_inter", attn_scale=0.4, floor_scale=3)
    assert torch.autograd.gradcheck(
        lambda q, k, v: dual_chunk_attention(q, k, v, chunk_size=5, local_size=1,
                                             scaling=scaling), (q, k, v))


def test_no_op_settings_equal_plain_dca() -> None:
    q, k, v = make_qkv(1, 30, 2, 2, 8)
    plain = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3)
    for scaling in (DCAScaling(), DCAScaling("log"), DCAScaling("yarn", original_length=30)):
        # none; log below floor_scale (8192); yarn at its original length: every factor is 1
        out = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, scaling=scaling)
        assert torch.equal(out, plain)


def test_defaults_are_the_sources() -> None:
    llama4 = Llama4TextConfig()
    assert DCAScaling().attn_scale == llama4.attn_scale == 0.1
    assert DCAScaling().floor_scale == llama4.floor_scale == 8192
    assert DCAScaling().original_length is None and DCAScaling().parts == "all"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "ntk"}, "dca_scaling 'ntk' is unknown"),
    ({"kind": "log", "parts": "intra"}, "dca_scaling_parts 'intra' is unknown"),
    ({"kind": "log", "floor_scale": 0}, "dca_scaling_floor_scale must be a positive integer"),
    ({"kind": "yarn", "original_length": 0}, "dca_scaling_original_length must be positive"),
    ({"kind": "yarn", "attn_scale": -0.1}, "dca_scaling_attn_scale must be >= 0"),
])
def test_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DCAScaling(**kwargs)


def cp_slice(x: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's pieces r and 2n-1-r of [b, S, ...] (the load-balanced layout)."""
    p = x.shape[1] // (2 * n)
    return torch.cat([x[:, r * p:(r + 1) * p], x[:, (2 * n - 1 - r) * p:(2 * n - r) * p]], dim=1)


def _cp_worker(root: str) -> None:
    """One rank of a CP=2 run over the default group: scaled DCA vs the same at CP=1."""
    world, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = make_qkv(2, 48, 4, 2, 8, seed=5)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    errors = {}
    for scaling in (DCAScaling("log", "succ_inter", attn_scale=0.3, floor_scale=5),
                    DCAScaling("yarn", original_length=12)):
        full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        expected = dual_chunk_attention(*full, chunk_size=16, local_size=4, scaling=scaling)
        expected.backward(dout)
        local = [cp_slice(x.detach(), world, rank).requires_grad_() for x in (q, k, v)]
        out = cp_dual_chunk_attention(*local, chunk_size=16, local_size=4, group=dist.group.WORLD,
                                      scaling=scaling)
        out.backward(cp_slice(dout, world, rank))
        pairs = [(out, expected)] + [(x.grad, f.grad) for x, f in zip(local, full)]
        errors[scaling.kind] = max((a - cp_slice(b, world, rank)).abs().max().item()
                                   for a, b in pairs)
    torch.save(errors, Path(root) / f"rank{rank}.pt")


@pytest.mark.slow
def test_context_parallel_scaled_dca_equals_cp1(tmp_path: Path) -> None:
    spawn(_cp_worker, str(tmp_path), world=2, tp=1)
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(errors) == {"log", "yarn"} and max(errors.values()) < 1e-10, errors


def test_model_layers_get_the_configured_scaling(single_process) -> None:
    attention = AttentionConfig(kind="dca", dca_chunk_size=16, dca_local_size=4,
                                dca_scaling="yarn", dca_scaling_parts="inter",
                                dca_scaling_original_length=8)
    model = build_gpt(transformer_config(ModelConfig(), attention), 256, 64)
    cores = [m for m in model.modules() if isinstance(m, DCACoreAttention)]
    assert len(cores) == ModelConfig().num_layers
    assert all(c.scaling == DCAScaling("yarn", "inter", original_length=8) for c in cores)


@pytest.mark.parametrize(("attention", "message"), [
    (dict(dca_scaling="log"), "dca_scaling \\('log'\\) applies to attention kind 'dca'"),
    (dict(kind="dca", dca_scaling="bogus"), "dca_scaling 'bogus' is unknown"),
    (dict(kind="dca", dca_scaling="log", dca_scaling_floor_scale=-1),
     "dca_scaling_floor_scale must be a positive integer"),
])
def test_model_config_refuses_bad_scaling(attention: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        transformer_config(ModelConfig(), AttentionConfig(**attention))
