"""Full-layer activation recompute that keeps each layer's core-attention result.

megatron's full recompute (`recompute_granularity="full"`) keeps only each layer's input and
re-runs the whole layer in backward, core attention included. At long context the core attention
is most of a layer's work (for gpt_1p3b: 60% of the training FLOPs at 32K, 86% at 128K), so
re-running its forward costs about a quarter more time, while its result is small: the output
(`[b, s, hq, d]`, as large as the layer input) and a float32 log-sum-exp per query and head.
With `recompute_keep_attention` a core attention inside a recomputed layer keeps those two and
only the cheap rest of the layer (norms, projections, RoPE, MLP) runs twice:

    no recompute     all activations kept (gpt_1p3b: ~60 KB per token and layer)
    full recompute   layer input (4 KB); attention forward runs twice
    full + keep      layer input + attention out + LSE (8 KB); attention forward runs once

How: megatron's `CheckpointFunction` runs a recomputed chunk's forward under `no_grad` with
`is_checkpointing()` set, and re-runs it in its backward with grad enabled, still checkpointing.
`AttentionKeeper.scope` turns that into a mode for each core-attention call:

    record  (checkpointed forward, no grad): compute, and push (out, lse) onto the module's FIFO;
    replay  (recompute, grad on): pop them; the attention's autograd function saves the
            recomputed q, k, v with the kept out, lse and skips its kernels.

The backward is the attention's usual one, which needs exactly (q, k, v, out, lse). Attention
functions take part through `kept_attention()` / `keep_attention()`; one that ignores them is
simply recomputed as before. A replay that finds nothing kept computes as usual too.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch

try:
    from megatron.core.tensor_parallel.random import is_checkpointing
except ImportError:  # pragma: no cover - older/newer megatron without the flag: keep nothing
    def is_checkpointing() -> bool:
        return False

RECORD, REPLAY = "record", "replay"

# The (keeper, mode) of the core-attention call in progress; one at a time (layers run in order).
_active: tuple[AttentionKeeper, str] | None = None


class AttentionKeeper:
    """FIFO of kept (out, lse) pairs for one core-attention module.

    FIFO rather than a single slot so that several forwards may precede their backwards (grad
    accumulation schedules): backwards recompute micro-batches in the order they ran forward.
    """

    def __init__(self) -> None:
        self._kept: collections.deque[tuple[torch.Tensor, ...]] = collections.deque()

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        self._kept.clear()

    @contextlib.contextmanager
    def scope(self, enabled: bool) -> Iterator[str | None]:
        """Make this module's mode current for one call: record, replay or None (compute)."""
        global _active
        mode = None
        if enabled and is_checkpointing():
            mode = REPLAY if torch.is_grad_enabled() else RECORD
        previous, _active = _active, (self, mode) if mode else None
        try:
            yield mode
        finally:
            _active = previous


def keeping() -> bool:
    """True inside a record or replay scope: attention should take its (out, lse) path."""
    return _active is not None


def kept_attention(shape: torch.Size) -> tuple[torch.Tensor, ...] | None:
    """When replaying, the kept results of this call (out of `shape` first); else None."""
    if _active is None or _active[1] != REPLAY or not len(_active[0]):
        return None
    kept = _active[0]._kept.popleft()
    if kept[0].shape != shape:
        raise RuntimeError(
            f"kept attention output {tuple(kept[0].shape)} does not match this recompute's "
            f"{tuple(shape)}: a forward ended without its backward; rebuild the model")
    return kept


def keep_attention(*tensors: torch.Tensor) -> None:
    """When recording, keep (out, lse, ...) for this call's recompute; else nothing."""
    if _active is not None and _active[1] == RECORD:
        _active[0]._kept.append(tuple(t.detach() for t in tensors))
