"""How a model runs, as opposed to what it is: the one options object from a run's config to the
model factory (`models.gpt.build_model`, `transformer_config`). Plain values only, so the
trainer's config code can build it without importing torch or megatron.

The choices among these are `StrEnum`s declared once, here (the `trainer` group's fields and
`BuildOptions` use them): Hydra refuses any other value when it composes the config, and a
member still equals its string (`kernel == "fa4"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AttentionKernel(StrEnum):
    """`trainer.attention_kernel`: the GPU kernel of every attention kind
    (models/attention/kernels.py)."""

    auto = "auto"  # FlashAttention-4 on SM90+ when it imports, else cudnn
    fa4 = "fa4"
    cudnn = "cudnn"
    flash = "flash"
    math = "math"


class DCABackward(StrEnum):
    """`trainer.dca_backward`: DCA's path under FA4 where its own kernels apply
    (models/attention/dca/dispatch.py)."""

    auto = "auto"  # both kernels, the backward in groups of heads or pieces of query rows
    one_piece = "one_piece"  # the backward in one piece
    parts = "parts"  # the part calls both ways


class Recompute(StrEnum):
    """`trainer.recompute`: megatron's activation recomputation."""

    none = "none"
    selective = "selective"
    full = "full"


# Run settings that AttentionConfig (what a model is) held before they moved to the run's
# settings: their old name in the `attention` group -> their name in the `trainer` group (and in
# BuildOptions). A checkpoint record written before the move drops them when read (ckpt/meta.py);
# the old name on a command line is refused naming the new one (trainer/config.py).
MOVED_FROM_ATTENTION = {"kernel": "attention_kernel", "dca_backward": "dca_backward",
                        "dca_keep_rotated": "dca_keep_rotated"}


@dataclass(frozen=True)
class BuildOptions:
    """Precision, device, kernels, recomputation, fusions (see `TrainerConfig` for their
    meaning)."""

    bf16: bool = False
    on_gpu: bool = False
    attention_kernel: AttentionKernel = AttentionKernel.auto
    recompute: Recompute = Recompute.none
    recompute_modules: tuple[str, ...] = ()
    recompute_num_layers: int = 0
    recompute_keep_attention: bool = False
    fused_norm: bool = False
    fused_rope: bool = False
    dca_cuda_graphs: bool = False
    dca_backward: DCABackward = DCABackward.auto
    dca_keep_rotated: bool = False
    # False: parameters are allocated but not randomly initialised (every one is about to be
    # overwritten, e.g. by an import): no fp32 master copies, no init time.
    initialize: bool = True
