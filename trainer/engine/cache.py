"""A static KV cache around the trainer's own GPTModel, and the three ways a forward uses it.

The cache is preallocated per layer, `[batch, kv_heads, length, head_dim]` in the model's dtype,
so a decode step has static shapes (a CUDA graph replays it). Every forward stays the model's
own (megatron's modules and weights); only two things are substituted while the cache is in use
(`LayerCache.mode`):

- `record` (a prompt's prefill): each core attention runs unchanged (the trainer's kernels)
  while a pre-hook writes its keys and values into the cache rows `[0, n)` of the batch's slots;
- `extend` (a long prompt prefilled in pieces): a piece of queries at positions `[start, start +
  p)` attends to the cache through the exported models' functions
  (`ckpt/remote_code/longctx_attention.py`), and megatron's rotary table starts at `start`;
- `step` (one decode step): one new token per row at its own position `pos[b]` (a device
  tensor): its key and value are written at `pos[b]`, the query attends to keys `[0, pos[b]]`
  through `models.attention.decode.decode_attention`, and the rotary rows are gathered at `pos`.

Keys: layers that megatron rotates cache rotated keys; DCA layers (which rotate q and k
themselves) cache keys rotated to their in-chunk offset `j mod L` with the trainer's DCA tables,
so a query is rotated three ways against them (`decode_attention`); chunked models' NoPE layers
cache keys unrotated.

DCA's logit scaling (`attention.dca_scaling`) multiplies each query's rotated copies by its
factors (models/attention/dca/scaling.py): a prompt's tokens take the factors of their prefill
(positions in a prompt of its length), a generated token those of its position at a length of
position + 1, and the cache keeps what each token's layers computed (keys carry no factor;
scaling.py says where vLLM's decoding differs). Under a length-dependent scaling (`yarn`) a
prefill's padded rows therefore take each prompt's own length (`record`'s `lengths`, which the
DCA layers read), and so does each later piece of a prompt prefilled in pieces (`extend`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.module import Float16Module

from ckpt.remote_code.longctx_attention import causal_attention, dca_attention, dca_positions
from models.attention.chunked_module import ChunkedCoreAttention
from models.attention.dca.module import DCACoreAttention
from models.attention.dca.scaling import token_factors
from models.attention.decode import decode_attention
from models.attention.rope import apply_rope, rope_cos_sin


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a bf16 wrapper (or the model itself)."""
    return model.module if isinstance(model, Float16Module) else model


class LayerCache:
    """The static cache of one model and the core-attention substitutions that use it."""

    def __init__(self, model: torch.nn.Module, batch: int, length: int) -> None:
        gpt = unwrapped(model)
        self.rotary = gpt.rotary_pos_emb
        self.cores = [layer.self_attention.core_attention for layer in gpt.decoder.layers]
        config = gpt.config
        kv_heads = config.num_query_groups
        head_dim = config.kv_channels
        param = next(gpt.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch, self.length = batch, length
        shape = (batch, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in self.cores]
        self.values = [torch.zeros_like(k) for k in self.keys]
        # DCA layers' RoPE tables [C + 1, d] (float32, the attention factor included)
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, core in enumerate(self.cores):
            if isinstance(core, DCACoreAttention):
                self.tables[i] = rope_cos_sin(torch.arange(core.chunk_size + 1), head_dim,
                                              core.rope_theta, core.mscale,
                                              dtype=torch.float32, device=self.device,
                                              scaling=core.rope_scaling)
        # megatron's rotary rows for every cached position [length, 1, 1, d] (made once, before
        # any graph capture: its forward is cached per length)
        self.rotary_table = self.rotary(length)
        # a decode step's input: the new token's position per row; and the row indices its
        # writes use. Both live as long as the cache: a captured graph reads their memory.
        self.pos = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.rows = torch.arange(batch, device=self.device)
        # DCA's logit scaling (every DCA layer has the same), and a step's factors [b, 3]
        scaled = [core for core in self.cores
                  if isinstance(core, DCACoreAttention) and core.scaling.active]
        self.scaled = scaled[0] if scaled else None
        self.factors: torch.Tensor | None = None

    def _factors(self, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """[..., 3] DCA logit factors of queries at `positions` in sequences of `lengths`."""
        if self.scaled is None:
            return None
        return token_factors(self.scaled.scaling, self.scaled.chunk_size, positions, lengths)

    # -- what each mode writes and attends -------------------------------------------------

    def _rotate_dca_keys(self, i: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """DCA layer i's keys k [b, s, hk, d] at `positions` ([s] or [b, s]) rotated to their
        in-chunk offset."""
        core = self.cores[i]
        cos, sin = self.tables[i]
        r, _, _ = dca_positions(positions, core.chunk_size, core.local_size)
        return apply_rope(k, cos[r], sin[r])

    def _record(self, slots: slice, start: int, i: int, key: torch.Tensor,
                value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write megatron's key, value [s, b, hk, d] at positions [start, start + s) of the
        batch rows `slots`; returns views of the layer's cache rows [b, hk, start + s, d]."""
        s = key.shape[0]
        k, v = key.transpose(0, 1), value.transpose(0, 1)  # [b, s, hk, d]
        if i in self.tables:
            k = self._rotate_dca_keys(i, k, torch.arange(start, start + s, device=k.device))
        self.keys[i][slots, :, start:start + s] = k.transpose(1, 2)
        self.values[i][slots, :, start:start + s] = v.transpose(1, 2)
        return self.keys[i][slots, :, :start + s], self.values[i][slots, :, :start + s]

    def _extend_forward(self, i: int, slots: slice, start: int, factors: torch.Tensor | None):
        core = self.cores[i]

        def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
            k, v = self._record(slots, start, i, key, value)  # [b, hk, start + s, d]
            q = query.permute(1, 2, 0, 3)  # [s, b, hq, d] -> [b, hq, s, d]
            scale = core.scale(q)
            if i in self.tables:
                cos, sin = self.tables[i]
                out = dca_attention(q, k.to(q.dtype), v.to(q.dtype),
                                    chunk_size=core.chunk_size, local_size=core.local_size,
                                    cos=cos, sin=sin, scale=scale, factors=factors)
            else:
                chunk = core.chunk_size if isinstance(core, ChunkedCoreAttention) else None
                out = causal_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale,
                                       chunk_size=chunk)
            return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, hq * d]

        return forward

    def _step_forward(self, i: int):
        core = self.cores[i]
        rows = self.rows
        if i in self.tables:
            kind = "dca"
        elif isinstance(core, ChunkedCoreAttention):
            kind = "chunked"
        else:
            kind = "standard"
        chunk = getattr(core, "chunk_size", None)
        local = getattr(core, "local_size", None)

        def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
            k, v = key[0], value[0]  # [1, b, hk, d] -> [b, hk, d]
            if kind == "dca":
                k = self._rotate_dca_keys(i, k[:, None], self.pos[:, None])[:, 0]
            self.keys[i][rows, :, self.pos] = k.to(self.dtype)
            self.values[i][rows, :, self.pos] = v.to(self.dtype)
            q = query[0]  # [b, hq, d]
            cos, sin = self.tables.get(i, (None, None))
            out = decode_attention(q, self.keys[i], self.values[i], self.pos + 1,
                                   scale=core.scale(q), kind=kind, chunk_size=chunk,
                                   local_size=local, cos=cos, sin=sin,
                                   factors=self.factors if kind == "dca" else None)
            return out.flatten(1)[None]  # [1, b, hq * d]

        return forward

    # -- the modes ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self, slots: slice, lengths: tuple[int, ...] | None = None) -> Iterator[None]:
        """A whole-prompt forward of the batch `slots` (rows from position 0) through the
        model's own attention, its keys and values written into the cache; `lengths`: each
        row's prompt length (rows padded to the longest), for DCA's length-dependent scaling."""
        def hook(i: int):
            def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
                self._record(slots, 0, i, args[1], args[2])
            return pre

        handles = [core.register_forward_pre_hook(hook(i)) for i, core in enumerate(self.cores)]
        dca = [core for core in self.cores if isinstance(core, DCACoreAttention)]
        for core in dca:
            core.row_lengths = lengths
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for core in dca:
                core.row_lengths = None

    @contextlib.contextmanager
    def extend(self, slots: slice, start: int, end: int, total: int) -> Iterator[None]:
        """A forward of the tokens at positions [start, end) of the batch `slots`, the earlier
        ones already cached, of prompts `total` tokens long (DCA's length scaling)."""
        original = self.rotary.forward
        positions = torch.arange(start, end, device=self.device)
        factors = self._factors(positions, torch.full_like(positions, total))  # [p, 3]
        factors = None if factors is None else factors.T.contiguous()

        def rotary(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
            return original(start + max_seq_len, *args, **kwargs)[start:]

        with self._substituted(rotary, [self._extend_forward(i, slots, start, factors)
                                        for i in range(len(self.cores))]):
            yield

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A forward of one token per row at positions `self.pos` (every slot of the cache)."""
        table = self.rotary_table

        def rotary(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
            # once per step, before any layer (a captured graph recomputes them from pos)
            self.factors = self._factors(self.pos, self.pos + 1)
            return table[self.pos].transpose(0, 1)  # [length, 1, 1, d] -> [1, b, 1, d]

        with self._substituted(rotary, [self._step_forward(i) for i in range(len(self.cores))]):
            yield

    @contextlib.contextmanager
    def _substituted(self, rotary, forwards: list) -> Iterator[None]:
        self.rotary.forward = rotary
        for core, forward in zip(self.cores, forwards):
            core.forward = forward
        try:
            yield
        finally:
            del self.rotary.forward
            for core in self.cores:
                del core.forward
