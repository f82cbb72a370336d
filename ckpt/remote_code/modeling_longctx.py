"""transformers model of a longctx export: Llama (or Qwen2: q/k/v biases) whose attention is the
trainer's variant, with a KV cache for `generate()`.

Per layer, by the config's "longctx" settings: Dual Chunk Attention (keys cached rotated to their
in-chunk offset; each new query rotated three ways), chunked attention (Llama 4: a query sees its
own chunk; every `global_layer_interval`-th layer global and without RoPE) or standard causal
attention; optionally a sigmoid gate per head on the attention output (`gate_proj`). DCA may
scale its logits (`dca_factors`): `log` by each query's position, `yarn` by the sequence's length
after the forward (a prompt's length in the prefill, position + 1 for each new token). Batches
must be unpadded (every row of `attention_mask` all ones): the layers ignore the mask and compute
their own. The cache may be dynamic or static (`generate(..., cache_implementation="static")`,
which transformers compiles on CUDA): positions come from the cache's length (a tensor for a
static cache, so a compiled decoding step has no host sync), and a static cache's whole buffer
is attended with later positions masked (longctx_attention.py).
"""

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from .configuration_longctx import LongCtxConfig, LongCtxQwen2Config
from .longctx_attention import causal_attention, dca_attention, dca_positions, rotate


def layer_kind(settings: dict, layer_idx: int) -> str:
    """"dca", "chunked", "global" (chunked models' NoPE layers) or "standard"."""
    kind = settings.get("attention", "standard")
    interval = settings.get("global_layer_interval", 0)
    if kind == "chunked" and interval > 0 and (layer_idx + 1) % interval == 0:
        return "global"
    return kind


SCALED_PARTS = {"all": 0, "succ_inter": 1, "inter": 2}  # the first of DCA's parts each scales


def dca_factors(settings: dict, pos: torch.Tensor) -> torch.Tensor | None:
    """[3, s] float32 logit factors of queries at positions `pos` [s] for DCA's own-chunk,
    previous-chunk and older keys, or None without a scaling. `log`: Llama 4's temperature,
    1 + attn_scale * ln(floor((p + 1) / floor_scale) + 1); `yarn`: Qwen2.5-1M's, m^2 with
    m = max(1, attn_scale * ln(n / original_length) + 1) and n the sequence's length after this
    forward, for every key (the trainer's engine decodes by the same rule)."""
    kind = settings.get("dca_scaling", "none")
    if kind == "none":
        return None
    p = pos.to(torch.float64)
    scale = settings["dca_scaling_attn_scale"]
    if kind == "log":
        f = 1 + scale * torch.log1p(torch.floor((p + 1) / settings["dca_scaling_floor_scale"]))
    else:
        n = p[-1:] + 1  # a tensor: a static cache's positions are read without a host sync
        m = (scale * torch.log(n / settings["dca_scaling_original_length"]) + 1).clamp(min=1)
        f = (m * m).expand_as(p)
    parts = torch.arange(3, device=pos.device)[:, None]
    return torch.where(parts >= SCALED_PARTS[settings["dca_scaling_parts"]], f[None],
                       1.0).float()


class LongCtxAttention(LlamaAttention):
    """Llama's attention projections (q/k/v biases if `qkv_bias`) with the layer's variant."""

    def __init__(self, config: LongCtxConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.settings = config.longctx
        self.kind = layer_kind(self.settings, layer_idx)
        bias = self.settings.get("qkv_bias", False)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if bias:
            self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=True)
            self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=True)
            self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=True)
        self.gate_proj = (nn.Linear(config.hidden_size, heads, bias=bias)
                          if self.settings.get("head_wise_attn_gate") else None)
        # DCA rotates to positions 0..chunk_size only: its own table, the model's RoPE scaling
        self.rotary = LlamaRotaryEmbedding(config) if self.kind == "dca" else None
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _dca_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [chunk_size + 1, d] in float32 (attention factor included), made once."""
        if device not in self._tables:
            table = torch.arange(self.settings["dca_chunk_size"] + 1, device=device)[None]
            dummy = torch.zeros((), device=device)  # float32: the tables' dtype
            self._tables[device] = tuple(t[0] for t in self.rotary(dummy, table))
        return self._tables[device]

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, past_key_values=None,
                **kwargs) -> tuple[torch.Tensor, None]:
        # transformers 5 passes `cache`; earlier releases `past_key_values` / `past_key_value`
        cache = next((c for c in (cache, past_key_values, kwargs.get("past_key_value"))
                      if c is not None), None)
        b, s, _ = hidden_states.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [b, hq, s, d]
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # [b, hk, s, d]
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        # the tokens' positions: a dynamic cache's length is an int, a static cache's a tensor
        # (read without a host sync); older transformers pass `cache_position`
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        pos = kwargs.get("cache_position")
        if pos is None:
            pos = torch.arange(s, device=q.device) + past
        if self.kind == "dca":
            chunk, local = self.settings["dca_chunk_size"], self.settings["dca_local_size"]
            cos, sin = self._dca_tables(q.device)
            r, _, _ = dca_positions(pos, chunk, local)
            k = rotate(k, cos[r], sin[r])
        elif self.kind != "global":
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # a dynamic cache returns exactly the keys so far (the queries are the last s); a
        # static one its whole preallocated buffer, masked by the queries' positions
        exact = (kwargs.get("cache_position") is None and isinstance(past, int)
                 and k.shape[2] == past + s)
        positions = None if exact else pos
        if self.kind == "dca":
            out = dca_attention(q, k, v, chunk_size=chunk, local_size=local, cos=cos, sin=sin,
                                scale=self.scaling, positions=positions,
                                factors=dca_factors(self.settings, pos))
        else:
            out = causal_attention(q, k, v, scale=self.scaling, chunk_size=self.settings.get(
                "chunk_size") if self.kind == "chunked" else None, positions=positions)
        out = out.transpose(1, 2)  # [b, s, hq, d]
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(hidden_states).float())  # [b, s, hq]
            out = (out * gate[..., None]).to(out.dtype)
        return self.o_proj(out.reshape(b, s, -1)), None


class LongCtxModel(LlamaModel):
    config_class = LongCtxConfig

    def __init__(self, config: LongCtxConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            layer.self_attn = LongCtxAttention(config, i)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(
                attention_mask.all()):
            raise ValueError("longctx models take unpadded batches (attention_mask all ones): "
                             "DCA and chunked positions count from each row's first token")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class LongCtxForCausalLM(LlamaForCausalLM):
    config_class = LongCtxConfig

    def __init__(self, config: LongCtxConfig) -> None:
        super().__init__(config)
        self.model = LongCtxModel(config)
        self.post_init()


class LongCtxQwen2ForCausalLM(LongCtxForCausalLM):
    """The model of a Qwen2-typed DCA export (configuration_longctx.LongCtxQwen2Config)."""

    config_class = LongCtxQwen2Config
