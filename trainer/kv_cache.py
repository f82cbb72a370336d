"""A KV cache for the trainer's GPTModel (TP=1), for `python -m trainer.generate`.

The prompt runs through the model's own forward (the trainer's attention, unchanged) while a
hook on every core attention records its keys and values. Each later token runs through the same
forward, megatron's modules and weights throughout, with two substitutions: the rotary table
starts at the cached length (megatron numbers a call's tokens from 0), and each core attention
answers the new queries from the cache (ckpt/remote_code/longctx_attention.py, the functions the
exported models run): DCA keys are cached rotated to their in-chunk offset with the trainer's
RoPE tables (models/attention/rope.py); other layers cache the keys megatron rotated (or not, in
chunked models' NoPE layers). tests/trainer/test_generate.py checks it against recomputation.
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
from models.attention.rope import apply_rope, rope_cos_sin
from trainer.evals.decoding import logits_of


class CachedDecoder:
    """Logits of a growing sequence [b, n], one forward of the new tokens per call."""

    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        self.model = model
        gpt = model.module if isinstance(model, Float16Module) else model
        self.rotary = gpt.rotary_pos_emb
        self.cores = [layer.self_attention.core_attention for layer in gpt.decoder.layers]
        for core in self.cores:
            if isinstance(core, DCACoreAttention) and core.scaling.active:
                raise ValueError("attention.dca_scaling depends on the whole sequence's length, "
                                 "so cached decoding cannot reproduce it: set "
                                 "attention.dca_scaling=none or kv_cache=false")
        self.vocab_size = vocab_size
        self.keys: list[torch.Tensor | None] = [None] * len(self.cores)  # [b, hk, n, d] each
        self.values: list[torch.Tensor | None] = [None] * len(self.cores)
        self.length = 0
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # DCA's, per layer

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, vocab] after the prompt `tokens` [b, n] (the trainer's forward)."""
        handles = [core.register_forward_pre_hook(self._record(i))
                   for i, core in enumerate(self.cores)]
        try:
            logits = logits_of(self.model, tokens, self.vocab_size)
        finally:
            for handle in handles:
                handle.remove()
        self.length = tokens.shape[1]
        return logits[:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, vocab] after `tokens` [b, n] appended to the cached sequence."""
        with self._from_cache():
            logits = logits_of(self.model, tokens, self.vocab_size)
        self.length += tokens.shape[1]
        return logits[:, -1]

    def _append(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Add a layer's new keys and values ([s, b, h, d], megatron's) to its cache."""
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, hk, s, d]
        core = self.cores[i]
        if isinstance(core, DCACoreAttention):  # keys rotated once, to their in-chunk offset
            cos, sin = self._dca_tables(i, k)
            pos = torch.arange(self.length, self.length + k.shape[2], device=k.device)
            r, _, _ = dca_positions(pos, core.chunk_size, core.local_size)
            k = apply_rope(k.transpose(1, 2), cos[r], sin[r]).transpose(1, 2)
        if self.keys[i] is not None:
            k, v = torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2)
        self.keys[i], self.values[i] = k, v
        return k, v

    def _dca_tables(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's DCA RoPE tables [C + 1, d] (the trainer's frequencies and attention
        factor), made once."""
        if i not in self.tables:
            core = self.cores[i]
            dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
            self.tables[i] = rope_cos_sin(torch.arange(core.chunk_size + 1), like.shape[-1],
                                          core.rope_theta, core.mscale, dtype=dtype,
                                          device=like.device, scaling=core.rope_scaling)
        return self.tables[i]

    def _record(self, i: int):
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            self._append(i, args[1], args[2])
        return hook

    @contextlib.contextmanager
    def _from_cache(self) -> Iterator[None]:
        offset, original = self.length, self.rotary.forward

        def rotary(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
            # rows offset.. of the table a forward of the whole sequence would use
            return original(max_seq_len + offset, *args, **kwargs)[offset:]

        self.rotary.forward = rotary
        for i, core in enumerate(self.cores):
            core.forward = self._cached_core(i)
        try:
            yield
        finally:
            del self.rotary.forward
            for core in self.cores:
                del core.forward

    def _cached_core(self, i: int):
        core = self.cores[i]

        def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
            k, v = self._append(i, key, value)
            q = query.permute(1, 2, 0, 3)  # [s, b, hq, d] -> [b, hq, s, d]
            scale = core.scale(q)
            if isinstance(core, DCACoreAttention):
                cos, sin = self._dca_tables(i, q)
                out = dca_attention(q, k, v, chunk_size=core.chunk_size,
                                    local_size=core.local_size, cos=cos, sin=sin, scale=scale)
            else:
                chunk = core.chunk_size if isinstance(core, ChunkedCoreAttention) else None
                out = causal_attention(q, k, v, scale=scale, chunk_size=chunk)
            return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, hq * d]

        return forward


