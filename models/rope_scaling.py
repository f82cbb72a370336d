"""RoPE inverse frequencies and attention factor under the common context-scaling schemes.

`rope_frequencies(head_dim, theta, scaling)` is the one place that turns RoPE settings into the
per-pair inverse frequencies [head_dim / 2] and the attention factor (the factor that multiplies
cos and sin, so attention logits scale by its square). Every RoPE user goes through it: the
model's rotary embedding (installed by `models.gpt.build_model`) and DCA's own rotation
(`models/attention/rope.py`). Schemes:

- none:    theta ** (-2i / d)
- linear:  position interpolation, inv_freq / factor
- ntk:     NTK-aware (bloc97), a static base theta * factor ** (d / (d - 2)); `dynamic` is the
           same function (transformers' dynamic scheme at its original length times factor)
- yarn:    per-frequency blend of interpolation and extrapolation between the beta_fast and
           beta_slow rotation counts, attention factor 0.1 ln(factor) + 1 unless given
- llama3:  Llama 3.1's wavelength bands (low_freq_factor, high_freq_factor)

The formulas follow the published definitions (and `transformers`' implementation, the tests'
oracle), but nothing here depends on a checkpoint format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALING_TYPES = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Scaling settings (hashable, so cached RoPE tables can key on them).

    factor: context extension factor s; original_max_position: the pretraining length (llama3,
    yarn); attention_factor: yarn's cos/sin factor (None: 0.1 ln s + 1).
    """

    type: str = "none"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.type not in SCALING_TYPES:
            raise ValueError(f"rope scaling type {self.type!r} is unknown; choose one of "
                             f"{SCALING_TYPES}")
        if self.type != "none" and self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.type in ("llama3", "yarn") and self.original_max_position <= 0:
            raise ValueError(f"rope scaling {self.type} needs original_max_position > 0 (the "
                             "pretraining context length)")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor "
                             f"({self.high_freq_factor}) > low_freq_factor "
                             f"({self.low_freq_factor})")


NO_SCALING = RopeScaling()


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     dtype: torch.dtype = torch.float32,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] in `dtype`, attention factor) for RoPE over `head_dim`."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {theta}")
    scaling = scaling or NO_SCALING
    kind, s = scaling.type, scaling.factor
    if kind in ("ntk", "dynamic"):
        theta = theta * s ** (head_dim / (head_dim - 2))
    exponent = torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim
    inv_freq = 1.0 / theta ** exponent
    if kind == "linear":
        return inv_freq / s, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling), attention_factor(scaling)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Keep high frequencies, divide low ones by the factor, interpolate smoothly between."""
    s, old = scaling.factor, scaling.original_max_position
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float,
          scaling: RopeScaling) -> torch.Tensor:
    """Dimensions turning fewer than beta_slow times over the original length interpolate,
    more than beta_fast times extrapolate, a linear ramp (over rounded bounds) between."""

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pair = torch.arange(head_dim // 2, dtype=inv_freq.dtype, device=inv_freq.device)
    interpolate = torch.clamp((pair - low) / (high - low), 0, 1)  # 0: extrapolate, 1: interpolate
    return inv_freq / scaling.factor * interpolate + inv_freq * (1 - interpolate)


def attention_factor(scaling: RopeScaling | None) -> float:
    """The cos/sin factor: YaRN's given one, else 0.1 ln(s) + 1 (1 for s <= 1); 1 otherwise."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0
