"""Length-dependent attention scaling for Dual Chunk Attention, as deployed long-context systems do.

Both options multiply the logits of query i by a factor f_i >= 1 (a sharper softmax as the
context grows) on the DCA parts chosen by `parts`; f folds into the rotated query of those parts,
so the kernels and the exact-gradient recipe are unchanged (dq picks up the same f).

  log   Llama 4's `attn_temperature_tuning` (transformers' Llama4TextAttention, applied there to
        its NoPE layers): with p the query's position in its document,
            f_i = 1 + attn_scale * ln(floor((p + 1) / floor_scale) + 1),
        attn_scale = 0.1 and floor_scale = 8192 in Llama 4's config (its attention chunk size).
  yarn  Qwen2.5-1M's DCA (vLLM's dual_chunk_flash_attn backend, `dual_chunk_attention_config`):
        YaRN's temperature for a document of n tokens,
            m = max(1, attn_scale * ln(n / original_length) + 1),   f = m^2
        (vLLM scales the keys by m and the softmax scale by m; YaRN's paper: sqrt(1/t) = 0.1 ln s
        + 1). attn_scale = 0.1 (YaRN); original_length defaults to the chunk size, as in
        Qwen2.5-1M's config (original_max_position_embeddings == chunk_size == 262144). n is
        the whole document's length in a forward; in cached decoding a query takes the factor
        of the length when it is computed (the prompt's length for the prompt, its own position
        + 1 for a generated token; trainer/engine/cache.py). vLLM differs there: it stores each
        key times the m of its own length, so a decoding query at length L meets a prompt key
        with m(L) m(n) where ours has m(L)^2, a relative difference of about 0.1 ln(L / n).

parts: "all" (both sources scale every logit of the query), "succ_inter" (successive and inter)
or "inter" (only keys two or more chunks back).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from models.schema import DCAScaledParts, DCAScalingKind

SCALING_KINDS = tuple(kind.value for kind in DCAScalingKind)  # the attention.dca_scaling choices
SCALED_PARTS = {DCAScaledParts.all.value: (0, 1, 2), DCAScaledParts.succ_inter.value: (1, 2),
                DCAScaledParts.inter.value: (2,)}  # DCA part indices


@dataclass(frozen=True)
class DCAScaling:
    """Which scaling, on which parts, with which constants (defaults: the sources')."""

    kind: str = "none"
    parts: str = "all"
    attn_scale: float = 0.1
    floor_scale: int = 8192
    original_length: int | None = None  # yarn: None means the DCA chunk size

    def __post_init__(self) -> None:
        if self.kind not in SCALING_KINDS:
            raise ValueError(f"dca_scaling {self.kind!r} is unknown; choose one of "
                             f"{SCALING_KINDS}")
        if self.parts not in SCALED_PARTS:
            raise ValueError(f"dca_scaling_parts {self.parts!r} is unknown; choose one of "
                             f"{tuple(SCALED_PARTS)}")
        if self.attn_scale < 0:
            raise ValueError(f"dca_scaling_attn_scale must be >= 0, got {self.attn_scale}")
        if isinstance(self.floor_scale, bool) or not isinstance(self.floor_scale, int) \
                or self.floor_scale <= 0:
            raise ValueError(f"dca_scaling_floor_scale must be a positive integer, got "
                             f"{self.floor_scale!r}")
        if self.original_length is not None and self.original_length <= 0:
            raise ValueError(f"dca_scaling_original_length must be positive (or null for the "
                             f"chunk size), got {self.original_length}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def length_dependent(self) -> bool:
        """Whether a query's factor depends on its document's length, not on its position
        alone (a batch of prompts padded to one width then needs each row's length:
        dual_chunk_attention's `lengths`)."""
        return self.kind == "yarn"


def token_factors(scaling: DCAScaling, chunk_size: int, positions: torch.Tensor,
                  lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., 3] logit factor per DCA part of the queries at `positions` in documents of
    `lengths` tokens (both [...], on one device), computed in float64. Torch ops on that
    device only: a captured decode step computes them from its position tensor."""
    pos, length = positions.to(torch.float64), lengths.to(torch.float64)
    if scaling.kind == "log":
        f = 1 + scaling.attn_scale * torch.log1p(torch.floor((pos + 1) / scaling.floor_scale))
    else:
        original = scaling.original_length or chunk_size
        m = (scaling.attn_scale * torch.log(length / original) + 1).clamp(min=1)
        f = m * m
    # the scaled parts are a suffix of (0, 1, 2): a mask from arange, no host-to-device copy
    scaled = torch.arange(3, device=f.device) >= SCALED_PARTS[scaling.parts][0]
    return torch.where(scaled, f[..., None], 1.0).to(dtype)


def query_factors(scaling: DCAScaling, chunk_size: int, seq: int,
                  bounds: tuple[int, ...] | None, num_parts: int, dtype: torch.dtype,
                  device: torch.device, offsets: tuple[int, ...] | None = None,
                  total: int | None = None,
                  lengths: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """[num_parts, seq] logit factor of every token's query per DCA part, or None if all are 1;
    [num_parts, batch, seq] where `lengths` gives each batch row's own document length.

    `bounds`: document boundaries (None: one document of `seq` tokens). Under context
    parallelism `offsets` gives each local token's global position and `total` the global
    length (one document). `lengths` (a batch of prompts padded to `seq`, in inference): row b's
    queries take the factors of a document of lengths[b] tokens.
    """
    table = _factors(scaling, chunk_size, seq, bounds, offsets, total, lengths)
    if table is None:
        return None
    return table[:num_parts].to(device=device, dtype=dtype, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _factors(scaling: DCAScaling, chunk_size: int, seq: int, bounds: tuple[int, ...] | None,
             offsets: tuple[int, ...] | None, total: int | None,
             lengths: tuple[int, ...] | None) -> torch.Tensor | None:
    """Float64 CPU table behind `query_factors` (cached: every layer asks for the same)."""
    if not scaling.active:
        return None
    if offsets is not None:
        pos, length = torch.tensor(offsets, dtype=torch.float64), torch.full((seq,), total)
    elif lengths is not None:  # [b, seq]: every row at positions 0.., its own length
        pos = torch.arange(seq, dtype=torch.float64).expand(len(lengths), seq)
        length = torch.tensor(lengths, dtype=torch.float64)[:, None].expand(-1, seq)
    elif bounds is None:
        pos, length = torch.arange(seq, dtype=torch.float64), torch.full((seq,), seq)
    else:
        edges = torch.tensor(bounds)
        sizes = edges.diff()
        pos = (torch.arange(seq) - edges[:-1].repeat_interleave(sizes)).to(torch.float64)
        length = sizes.repeat_interleave(sizes)
    table = token_factors(scaling, chunk_size, pos, length, torch.float64)  # [(b,) seq, 3]
    table = table.movedim(-1, 0)  # [3, (b,) seq]
    if bool((table == 1).all()):
        return None  # nothing to scale (e.g. every document within its trained length)
    return table.contiguous()


def describe(scaling: DCAScaling, chunk_size: int) -> str:
    """One line naming the scaling and every constant, for run tables and logs."""
    if not scaling.active:
        return "none"
    if scaling.kind == "log":
        return (f"log(attn_scale={scaling.attn_scale}, floor_scale={scaling.floor_scale}, "
                f"parts={scaling.parts})")
    return (f"yarn(attn_scale={scaling.attn_scale}, "
            f"original_length={scaling.original_length or chunk_size}, parts={scaling.parts})")

