"""Which axis megatron splits each checkpoint tensor on across TP ranks, and how.

A torch_dist checkpoint stores global tensors; a TP rank holds a slice of each along its "TP
axis". The rule is megatron's module naming (column-parallel layers split their output rows,
row-parallel layers their input columns, the embedding its vocabulary rows), and every rule is
checked against the chunks a TP>1 checkpoint actually stored (`checked_layout`), so a tensor the
rules do not know fails loudly instead of being mis-sliced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt.paths import CheckpointError

if TYPE_CHECKING:  # annotations only: the reader loads torch (zarr_manifest stays light)
    from ckpt.reader import TensorInfo

# Optimizer state mirrors a model tensor: `optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<key>`.
_OPTIMIZER = re.compile(r"^optimizer\.state\.[^.]+\.")
# The head-wise gate stores linear_qkv as two tensors, `<key>._qkv` and `<key>._gate`.
_FUSED_PART = re.compile(r"\._(qkv|gate)$")
_COLUMN_PARALLEL = ("word_embeddings.weight", "output_layer.weight", "output_layer.bias",
                    "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def model_key(key: str) -> str:
    """The model tensor a checkpoint key belongs to (optimizer state prefix removed)."""
    return _OPTIMIZER.sub("", key)


def is_optimizer_key(key: str) -> bool:
    return _OPTIMIZER.match(key) is not None


def is_stacked(key: str) -> bool:
    """Transformer layers are stored stacked: a leading axis indexes the layer."""
    return model_key(key).startswith("decoder.layers.")


@dataclass(frozen=True)
class TPLayout:
    """`axis`: the split axis (None: every rank holds the whole tensor). `blocks`: SwiGLU's
    `linear_fc1` holds [W; V] and each rank takes a slice of both, so 2 blocks split per rank."""

    axis: int | None
    blocks: int = 1

    def piece(self, size: int, tp: int) -> int:
        """Rows along the TP axis in one contiguous piece of one rank's slice."""
        return size // (self.blocks * tp)

    def problem(self, key: str, shape: tuple[int, ...], tp: int) -> str | None:
        """Why `shape` cannot be split `tp` ways, or None."""
        if self.axis is None or shape[self.axis] % (self.blocks * tp) == 0:
            return None
        parts = f"{self.blocks} x {tp}" if self.blocks > 1 else str(tp)
        return f"{key}: size {shape[self.axis]} along axis {self.axis} is not divisible by {parts}"

    def ranges(self, size: int, tp: int, rank: int) -> list[tuple[int, int]]:
        """[start, stop) ranges along the TP axis that TP rank `rank` of `tp` holds."""
        piece = self.piece(size, tp)
        block = size // self.blocks
        return [(b * block + rank * piece, b * block + (rank + 1) * piece)
                for b in range(self.blocks)]

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if self.axis is None:
            return shape
        out = list(shape)
        out[self.axis] = shape[self.axis] // tp
        return tuple(out)

    def describe(self) -> str:
        if self.axis is None:
            return "replicated"
        return f"axis {self.axis}" + (f" ({self.blocks} blocks)" if self.blocks > 1 else "")


def tp_layout(key: str, swiglu: bool) -> TPLayout:
    """The TP layout of a checkpoint tensor by its megatron name."""
    name = _FUSED_PART.sub("", model_key(key))
    prepend = int(is_stacked(key))
    if name.endswith(_COLUMN_PARALLEL):
        return TPLayout(prepend, 2 if swiglu and "linear_fc1." in name else 1)
    if name.endswith(_ROW_PARALLEL):
        return TPLayout(prepend + 1)
    return TPLayout(None)


def checked_layout(info: TensorInfo, swiglu: bool, tp: int) -> TPLayout:
    """`tp_layout`, confirmed by the chunks a checkpoint saved at `tp` holds: along the TP axis
    each chunk spans whole pieces of ranks' slices (megatron writes one piece per chunk); along
    other axes (but the stacked-layer axis) it spans the whole tensor."""
    layout = tp_layout(info.key, swiglu)
    for chunk in info.chunks:
        for axis, (offset, size) in enumerate(zip(chunk.offset, chunk.size)):
            if axis == 0 and is_stacked(info.key):
                continue
            if axis == layout.axis:
                piece = layout.piece(info.shape[axis], tp)
                ok = size % piece == 0 and offset % piece == 0
            else:
                ok = size == info.shape[axis]
            if not ok:
                raise CheckpointError(
                    f"{info.key}: a stored chunk (offset {chunk.offset}, size {chunk.size}) does "
                    f"not match the TP layout expected for it ({layout.describe()} at TP={tp}); "
                    "this tool does not know how megatron shards this tensor"
                )
    return layout
