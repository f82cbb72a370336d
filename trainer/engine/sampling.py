"""Choosing the next token: greedy, or a draw at a temperature from the top-p nucleus.

Each prompt draws from its own generator, seeded by (seed, the prompt's index), so its tokens do
not depend on which other prompts share its batch or on the batch's order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # the smallest set of tokens with this much probability
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature}: need a finite value >= 0 "
                             "(0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: need 0 < top_p <= 1")


def nucleus_sample(logits: torch.Tensor, temperature: float, top_p: float,
                   generator: torch.Generator | None) -> torch.Tensor:
    """One token [1] from logits [vocab]: a draw from the softmax at `temperature` restricted
    to the top-p nucleus (which always keeps the most likely token)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    pick = torch.multinomial(sorted_probs, 1, generator=generator)
    return order[pick]


class Sampler:
    """Next tokens [b] from logits [b, vocab] of the prompts `ids` (their indices in the call)."""

    def __init__(self, sampling: Sampling, ids: Sequence[int], device: torch.device) -> None:
        self.sampling = sampling
        self.generators = [] if sampling.temperature == 0 else [
            torch.Generator(device=device).manual_seed(sampling.seed * 1_000_003 + i)
            for i in ids]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        if s.temperature == 0:
            return logits.argmax(dim=-1)
        return torch.cat([nucleus_sample(row, s.temperature, s.top_p, g)
                          for row, g in zip(logits, self.generators)])
