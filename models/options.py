"""How a model runs, as opposed to what it is: the one options object from a run's config to the
model factory (`models.gpt.build_model`, `transformer_config`). Plain values only, so the
trainer's config code can build it without importing torch or megatron."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildOptions:
    """Precision, device, recomputation, fusions (see `TrainerConfig` for their meaning)."""

    bf16: bool = False
    on_gpu: bool = False
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ()
    recompute_num_layers: int = 0
    recompute_keep_attention: bool = False
    fused_norm: bool = False
    fused_rope: bool = False
    dca_cuda_graphs: bool = False
    # False: parameters are allocated but not randomly initialised (every one is about to be
    # overwritten, e.g. by an import): no fp32 master copies, no init time.
    initialize: bool = True
