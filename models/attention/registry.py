"""The attention variants: every kind declared once, with everything that depends on the kind.

`+attention=<kind>` (models.schema.AttentionConfig.kind, an `AttentionKind`: the same names as
`VARIANTS`, tests/test_architecture.py checks) picks one `AttentionVariant`:

    core      its megatron core-attention module (models/spec.py puts it in every layer);
    function  the pure function the module calls ([b, s, h, d] in and out);
    cp        the same under context parallelism (cp_variants.py), called by the module;
    probe     its attention probabilities for `trainer.eval`'s probe (probe.py);
    check     its settings' validation (models/config.py runs it);
    own_rope  the core rotates q and k itself: every layer skips megatron's RoPE, whose fused
              form must then be off;
    global_interval  every Nth layer runs the standard core without RoPE (0: none);
    exclusive settings of this kind that must keep their default under another kind.

Modules and functions are named "module:attribute" and imported on use, so a variant's
dependencies load only when it is chosen (tests/test_architecture.py resolves them all).
A new variant: a pure function, a core module, an entry here and a conf/attention/<kind>.yaml.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from models.attention.dca.scaling import DCAScaling
from models.schema import AttentionConfig


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _no_check(attention: AttentionConfig) -> None:
    pass


@dataclass(frozen=True)
class AttentionVariant:
    name: str
    core: str
    function: str
    cp: str
    probe: str
    check: Callable[[AttentionConfig], None] = _no_check
    own_rope: bool = False
    global_interval: Callable[[AttentionConfig], int] = lambda attention: 0
    exclusive: tuple[str, ...] = ()

    def core_attention(self) -> type:
        """The megatron core-attention module class."""
        return _load(self.core)

    def attention_function(self) -> Callable[..., Any]:
        return _load(self.function)

    def cp_function(self) -> Callable[..., Any]:
        return _load(self.cp)

    def probe_function(self) -> Callable[..., Any]:
        return _load(self.probe)


def dca_scaling(attention: AttentionConfig) -> DCAScaling:
    """The DCA scaling the `dca_scaling*` settings describe (validated)."""
    return DCAScaling(attention.dca_scaling, attention.dca_scaling_parts,
                      attention.dca_scaling_attn_scale, attention.dca_scaling_floor_scale,
                      attention.dca_scaling_original_length)


def _check_dca(attention: AttentionConfig) -> None:
    chunk, local = attention.dca_chunk_size, attention.dca_local_size
    if chunk <= 0 or local <= 0:
        raise ValueError(f"dca_chunk_size ({chunk}) and dca_local_size ({local}) must be positive")
    if chunk <= local:
        raise ValueError(f"dca_chunk_size ({chunk}) must exceed dca_local_size ({local}); the "
                         "chunk length is their difference")
    dca_scaling(attention)  # its own checks name the bad setting


def _check_chunked(attention: AttentionConfig) -> None:
    if attention.chunk_size <= 0:
        raise ValueError(f"chunk_size ({attention.chunk_size}) must be positive")
    if attention.global_layer_interval < 0:
        raise ValueError(f"global_layer_interval ({attention.global_layer_interval}) must be "
                         ">= 0 (0: no global layers)")


_PACKAGE = "models.attention"
VARIANTS: dict[str, AttentionVariant] = {v.name: v for v in (
    AttentionVariant(
        "standard", core=f"{_PACKAGE}.core:CausalCoreAttention",
        function=f"{_PACKAGE}.causal:causal_attention",
        cp=f"{_PACKAGE}.cp_variants:cp_causal_attention",
        probe=f"{_PACKAGE}.probe:causal_probabilities"),
    AttentionVariant(
        "dca", core=f"{_PACKAGE}.dca.module:DCACoreAttention",
        function=f"{_PACKAGE}.dca.attention:dual_chunk_attention",
        cp=f"{_PACKAGE}.cp_variants:cp_dual_chunk_attention",
        probe=f"{_PACKAGE}.probe:dca_probabilities",
        check=_check_dca, own_rope=True, exclusive=("dca_scaling",)),
    AttentionVariant(
        "chunked", core=f"{_PACKAGE}.chunked_module:ChunkedCoreAttention",
        function=f"{_PACKAGE}.chunked:chunked_attention",
        cp=f"{_PACKAGE}.cp_variants:cp_chunked_attention",
        probe=f"{_PACKAGE}.probe:chunked_probabilities",
        check=_check_chunked, global_interval=lambda attention: attention.global_layer_interval),
)}
STANDARD = VARIANTS["standard"]  # the core of every global layer


def variant(kind: str) -> AttentionVariant:
    """The variant registered for `kind`; ValueError naming the choices if there is none."""
    if kind not in VARIANTS:
        raise ValueError(f"attention kind {kind!r} is unknown; choose one of {tuple(VARIANTS)}")
    return VARIANTS[kind]


def check_attention(attention: AttentionConfig) -> AttentionVariant:
    """The chosen variant, its settings checked, and no other variant's exclusive setting
    changed from its default."""
    chosen = variant(attention.kind)
    chosen.check(attention)
    defaults = {f.name: _plain(f.default) for f in fields(AttentionConfig)}
    for other in VARIANTS.values():
        for name in other.exclusive if other is not chosen else ():
            value = _plain(getattr(attention, name))
            if value != defaults[name]:
                raise ValueError(f"{name} ({value!r}) applies to attention kind {other.name!r}, "
                                 f"not {chosen.name!r}; set {name} to {defaults[name]!r}")
    return chosen


def _plain(value: Any) -> Any:
    """A choice's member as its string (messages show 'log', not <DCAScalingKind.log: 'log'>)."""
    return value.value if isinstance(value, Enum) else value


def is_global_layer(attention: AttentionConfig, layer_number: int) -> bool:
    """A layer (1-based) that runs the standard core without RoPE (chunked's N, 2N, ...)."""
    interval = variant(attention.kind).global_interval(attention)
    return interval > 0 and layer_number % interval == 0


def no_rope_pattern(attention: AttentionConfig, num_layers: int) -> list[int] | None:
    """megatron's `no_rope_freq` list (1 = the layer skips RoPE), None when every layer uses it.

    A variant that rotates q and k itself (DCA: per-part positions) skips the standard RoPE in
    every layer; global layers use no positional encoding at all (Llama 4's iRoPE).
    """
    chosen = variant(attention.kind)
    if chosen.own_rope:
        return [1] * num_layers
    if chosen.global_interval(attention) > 0:
        return [int(is_global_layer(attention, n)) for n in range(1, num_layers + 1)]
    return None
