"""Tensor names and layouts between Hugging Face Llama-style models and megatron's GPTModel.

megatron fuses q/k/v into `linear_qkv` grouped per query group: for each K/V head g the rows are
[the q heads of group g..., k_g, v_g] (each head_dim rows), so a TP rank holding groups
[a, b) holds one contiguous row range. SwiGLU's gate and up projections are `linear_fc1` as
[gate; up] on every rank (each rank its slice of both). The embedding and output layer are
padded with zero rows to the padded vocabulary. Import builds each TP rank's local tensors
from slices of the HF tensors (`local_tensor`); export turns megatron's global (layer-stacked)
tensors back into HF tensors (`hf_tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from models.schema import ModelConfig, head_dim_of

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Shape:
    """The sizes the mapping needs, derived from a ModelConfig."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    qkv_bias: bool
    tied: bool
    gate: bool = False  # the head-wise output gate: `self_attn.gate_proj` ([heads, hidden])

    @classmethod
    def of(cls, m: ModelConfig, gate: bool = False) -> Shape:
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads,
                   m.num_query_groups or m.num_attention_heads,
                   head_dim_of(m),
                   m.ffn_hidden_size or 0, m.qkv_bias, not m.untie_embeddings, gate)

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


def expected_hf(s: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name an import reads, with its shape."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, s.hidden),
                                       "model.norm.weight": (s.hidden,)}
    if not s.tied:
        out["lm_head.weight"] = (vocab, s.hidden)
    q, kv = s.heads * s.head_dim, s.groups * s.head_dim
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (s.hidden,),
            p + "post_attention_layernorm.weight": (s.hidden,),
            p + "self_attn.q_proj.weight": (q, s.hidden),
            p + "self_attn.k_proj.weight": (kv, s.hidden),
            p + "self_attn.v_proj.weight": (kv, s.hidden),
            p + "self_attn.o_proj.weight": (s.hidden, q),
            p + "mlp.gate_proj.weight": (s.ffn, s.hidden),
            p + "mlp.up_proj.weight": (s.ffn, s.hidden),
            p + "mlp.down_proj.weight": (s.hidden, s.ffn),
        })
        if s.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if s.gate:
            out[p + "self_attn.gate_proj.weight"] = (s.heads, s.hidden)
            if s.qkv_bias:
                out[p + "self_attn.gate_proj.bias"] = (s.heads,)
    return out


class Source(Protocol):
    """Reads parts of HF tensors: rows [start, stop) (a 1-D tensor's elements), or columns."""

    def rows(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        ...

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor: ...


def _qkv(src: Source, s: Shape, prefix: str, kind: str, tp: int, rank: int) -> torch.Tensor:
    """This rank's fused [q of group g..., k_g, v_g] rows for its query groups."""
    groups = s.groups // tp
    g0 = rank * groups
    d, qpg = s.head_dim, s.per_group
    q = src.rows(f"{prefix}q_proj.{kind}", g0 * qpg * d, (g0 + groups) * qpg * d)
    k = src.rows(f"{prefix}k_proj.{kind}", g0 * d, (g0 + groups) * d)
    v = src.rows(f"{prefix}v_proj.{kind}", g0 * d, (g0 + groups) * d)
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(groups, qpg * d, *tail), k.reshape(groups, d, *tail),
                       v.reshape(groups, d, *tail)], dim=1)
    return fused.reshape(-1, *tail)


def _vocab_rows(src: Source, name: str, vocab: int, padded: int, tp: int,
                rank: int) -> torch.Tensor:
    """This rank's rows of the padded vocabulary: the HF rows it covers, zeros past `vocab`."""
    per = padded // tp
    start, stop = rank * per, (rank + 1) * per
    real = src.rows(name, min(start, vocab), min(stop, vocab))
    pad = torch.zeros((per - real.shape[0], *real.shape[1:]), dtype=real.dtype)
    return torch.cat([real, pad])


def local_tensor(param: str, s: Shape, src: Source, vocab: int, padded: int, tp: int,
                 rank: int) -> torch.Tensor:
    """TP rank `rank`'s local value of our parameter `param`, read from the HF tensors."""
    if param == "embedding.word_embeddings.weight":
        return _vocab_rows(src, "model.embed_tokens.weight", vocab, padded, tp, rank)
    if param == "output_layer.weight":
        name = "model.embed_tokens.weight" if s.tied else "lm_head.weight"
        return _vocab_rows(src, name, vocab, padded, tp, rank)
    if param == "decoder.final_layernorm.weight":
        return src.rows("model.norm.weight")
    match = _LAYER.match(param)
    if match is None:
        raise KeyError(f"no Hugging Face tensor maps to {param}")
    p = f"model.layers.{match.group(1)}."
    rest = match.group(2)
    ffn, q_cols = s.ffn // tp, s.heads * s.head_dim // tp
    if rest == "input_layernorm.weight":
        return src.rows(p + "input_layernorm.weight")
    if rest == "pre_mlp_layernorm.weight":
        return src.rows(p + "post_attention_layernorm.weight")
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        qkv = _qkv(src, s, p + "self_attn.", kind, tp, rank)
        if not s.gate:
            return qkv
        heads = s.heads // tp  # models/attention/head_gate.py: each rank's [qkv_r; gate_r]
        gate = src.rows(f"{p}self_attn.gate_proj.{kind}", rank * heads, (rank + 1) * heads)
        return torch.cat([qkv, gate])
    if rest == "self_attention.linear_proj.weight":
        return src.cols(p + "self_attn.o_proj.weight", rank * q_cols, (rank + 1) * q_cols)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([src.rows(p + "mlp.gate_proj.weight", rank * ffn, (rank + 1) * ffn),
                          src.rows(p + "mlp.up_proj.weight", rank * ffn, (rank + 1) * ffn)])
    if rest == "mlp.linear_fc2.weight":
        return src.cols(p + "mlp.down_proj.weight", rank * ffn, (rank + 1) * ffn)
    raise KeyError(f"no Hugging Face tensor maps to {param}")


def hf_tensors(read: Callable[[str], torch.Tensor], s: Shape,
               vocab: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from megatron's global checkpoint tensors (`read(key)`; layers stacked on
    axis 0), one megatron tensor in memory at a time."""
    yield "model.embed_tokens.weight", read("embedding.word_embeddings.weight")[:vocab]
    if not s.tied:
        yield "lm_head.weight", read("output_layer.weight")[:vocab]
    yield "model.norm.weight", read("decoder.final_layernorm.weight")
    d, qpg = s.head_dim, s.per_group
    per_layer = {  # megatron's checkpoint names the norms after the layer they feed (TE's layout)
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    for ours, theirs in per_layer.items():
        stacked = read(f"decoder.layers.{ours}")
        for i in range(s.layers):
            yield f"model.layers.{i}.{theirs}", stacked[i]
    fc1 = read("decoder.layers.mlp.linear_fc1.weight")
    for i in range(s.layers):
        gate, up = fc1[i].chunk(2)
        yield f"model.layers.{i}.mlp.gate_proj.weight", gate
        yield f"model.layers.{i}.mlp.up_proj.weight", up
    for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
        # A gated model's checkpoint stores [QKV; Gate] as two tensors (head_gate.py's factory).
        key = f"decoder.layers.self_attention.linear_qkv.{kind}"
        if s.gate:
            gate = read(f"{key}._gate")
            for i in range(s.layers):
                yield f"model.layers.{i}.self_attn.gate_proj.{kind}", gate[i]
        qkv = read(f"{key}._qkv" if s.gate else key)
        for i in range(s.layers):
            grouped = qkv[i].reshape(s.groups, (qpg + 2) * d, *qkv.shape[2:])
            q, k, v = grouped.split([qpg * d, d, d], dim=1)
            p = f"model.layers.{i}.self_attn."
            yield p + f"q_proj.{kind}", q.reshape(-1, *qkv.shape[2:])
            yield p + f"k_proj.{kind}", k.reshape(-1, *qkv.shape[2:])
            yield p + f"v_proj.{kind}", v.reshape(-1, *qkv.shape[2:])
