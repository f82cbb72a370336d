"""Head-wise attention output gate (Step-3.5-Flash style), fused into `linear_qkv`.

Each head's core-attention output is scaled by sigmoid(g_h) before `linear_proj`, where
g = W_g x (+ b_g) holds one scalar per head, computed from the same normalised input as QKV. W_g is
fused into `linear_qkv` as the trailing rows of every TP rank's local weight,

    local weight = [qkv_r; gate_r]    qkv_r: (q + 2 kv) / tp rows, gate_r: heads / tp rows,

so rank r's gate rows belong to its own heads. Checkpoints store the global layout [QKV; Gate] at
every TP size (`qkv_gate_sharded_factory`); the gate is orthogonal to the core attention, so it
works with every core (standard, DCA, chunked) unchanged.

The hook: two forward hooks on megatron's own submodules, no copy of megatron's forward.
- A forward hook on `linear_qkv` slices the gate off the end of the local output and hands megatron
  the plain QKV output, so `get_query_key_value_tensors` (every path of it) runs unchanged.
- A forward pre-hook on `linear_proj` scales each head of its input, the core-attention output,
  by sigmoid(gate) in float32 (cast back).
The gate lives on the module from one hook to the other, within one forward call. Under full
recompute megatron re-runs the whole layer, hooks included, so the recomputed gate is used; under
selective recompute only the core is re-run, and the gate is made and used outside it. Applying
the gate inside a core wrapper would be wrong there: the checkpointed core would capture the gate
by closure, outside the checkpoint's inputs.

Why not megatron's own `attention_output_gate` path (return the gate from
`get_query_key_value_tensors`, let `_apply_output_gate` multiply): the forward reads that flag
from the config, which also widens `linear_qkv` by a full head_dim per head, so the module would
need a config claiming the element-wise gate is on; and `_apply_output_gate` makes the gate
contiguous at the output's full [s, b, heads * head_dim] size and keeps a float32 sigmoid of that
size for backward, where one scalar per head and token suffices.

Bias: the gate has a bias only when `linear_qkv` has one (`add_qkv_bias`); its rows start at
`head_wise_attn_gate_init_bias` (2.0: sigmoid = 0.88). Without a bias g = W_g x starts near 0
(small gate rows), so every head starts scaled by about 0.5, a constant the next layers absorb.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_pg_size
from torch import Tensor, nn

from models.config import LongContextConfig

InitMethod = Callable[[Tensor], Any]
QkvOutput = tuple[Tensor, Tensor | None]  # a megatron linear's (output, bias)


def apply_head_gate(x: Tensor, gate: Tensor) -> Tensor:
    """Scale each head of `x` [s, b, np * hn] by sigmoid(`gate` [s, b, np]), in float32."""
    heads = x.unflatten(-1, (gate.shape[-1], -1))  # [s, b, np, hn]
    scaled = heads * torch.sigmoid(gate.float()).unsqueeze(-1)  # float32 [s, b, np, hn]
    return scaled.to(x.dtype).flatten(-2)  # [s, b, np * hn]


def fused_init(init_method: InitMethod, qkv_rows: int, gate_rows: int,
               scale: float) -> InitMethod:
    """Initialise a fused [qkv_r; gate_r] weight as a QKV weight and a gate weight x `scale`.

    `qkv_rows` and `gate_rows` are one rank's. The weight holds whole rank blocks: every rank's
    with megatron's CPU initialisation (which then keeps rank r's block), this rank's on the GPU.
    Drawing the global QKV rows first and the gate rows second makes the CPU initialisation the
    same model at every TP size, with the QKV rows of the ungated model of the same seed.
    """

    def init(weight: Tensor) -> None:
        blocks = weight.shape[0] // (qkv_rows + gate_rows)
        qkv = weight.new_empty(blocks, qkv_rows, weight.shape[1])
        gate = weight.new_empty(blocks, gate_rows, weight.shape[1])
        # Draw each part as one global matrix: the rank blocks are consecutive row chunks of it.
        init_method(qkv.view(blocks * qkv_rows, -1))
        init_method(gate.view(blocks * gate_rows, -1))
        with torch.no_grad():
            weight.view(blocks, -1, weight.shape[1]).copy_(torch.cat([qkv, gate * scale], dim=1))

    return init


def qkv_gate_sharded_factory(sh_ten: ShardedTensor, sharded_offsets: tuple,
                             gate_rows: int) -> ShardedTensorFactory:
    """Store a fused local [qkv_r; gate_r] `linear_qkv` weight or bias as `<key>._qkv` and
    `<key>._gate`, each TP-sharded along axis 0, so the global layout is [QKV; Gate] at every TP
    size (a plain TP split of the fused tensor would put gate rows on K/V rows at another TP size).

    `build` uses only its arguments and these layout constants: megatron rebuilds the factory
    with optimizer-state tensors in place of the parameter, and those reshard the same way.
    """
    axis = len(sharded_offsets)  # the TP axis, after the prepended (layer) axes
    tp_size = sh_ten.axis_fragmentations[axis]
    tp_rank = sh_ten.global_offset[axis] // sh_ten.local_shape[0]

    @torch.no_grad()
    def build(key: str, t: Tensor, replica_id: Any,
              flattened_range: slice | None) -> list[ShardedTensor]:
        if flattened_range is not None:
            raise NotImplementedError(
                "head_wise_attn_gate checkpoints need whole (unflattened) tensors: use the "
                "optimizer sharding type 'fully_reshardable', not 'dp_reshardable'"
            )
        qkv, gate = t.split([t.shape[0] - gate_rows, gate_rows])  # [qkv_r, ...], [gate_r, ...]
        return [
            ShardedTensor.from_rank_offsets(
                f"{key}.{part}", data, *sharded_offsets, (axis, tp_rank, tp_size),
                replica_id=replica_id, prepend_axis_num=axis,
            )
            for part, data in (("_qkv", qkv), ("_gate", gate))
        ]

    def merge(parts: list[Tensor]) -> Tensor:
        return torch.cat(parts)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id,
                                flattened_range=sh_ten.flattened_range)


def _linear_qkv_with_gate(build: Callable[..., nn.Module], heads: int,
                          scale: float) -> Callable[..., nn.Module]:
    """`linear_qkv`'s builder with `heads` gate rows appended to its output (split per rank)."""

    def build_fused(input_size: int, output_size: int, *, init_method: InitMethod,
                    tp_group: torch.distributed.ProcessGroup, **kwargs: Any) -> nn.Module:
        tp = get_pg_size(tp_group)
        init = fused_init(init_method, output_size // tp, heads // tp, scale)
        return build(input_size, output_size + heads, init_method=init, tp_group=tp_group,
                     **kwargs)

    return build_fused


class HeadGatedSelfAttention(SelfAttention):
    """megatron's `SelfAttention` with the head-wise output gate fused into `linear_qkv`."""

    def __init__(self, config: LongContextConfig, submodules: SelfAttentionSubmodules,
                 layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.padding,
                 cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        fused = replace(submodules, linear_qkv=_linear_qkv_with_gate(
            submodules.linear_qkv, config.num_attention_heads,
            config.attention.head_wise_attn_gate_init_weight_scale,
        ))
        super().__init__(config=config, submodules=fused, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        # Validation guarantees num_query_groups >= tp: this rank computes heads / tp heads.
        self.gate_rows = config.num_attention_heads // self.world_size
        self.linear_qkv_out_dim += config.num_attention_heads
        if self.linear_qkv.bias is not None:
            with torch.no_grad():
                bias = config.attention.head_wise_attn_gate_init_bias
                self.linear_qkv.bias[-self.gate_rows:].fill_(bias)
        self._gate: Tensor | None = None
        self.linear_qkv.register_forward_hook(self._split_off_gate)
        self.linear_proj.register_forward_pre_hook(self._apply_gate)

    def _split_off_gate(self, module: nn.Module, args: tuple, output: QkvOutput) -> QkvOutput:
        mixed, bias = output  # [s, b, qkv_r + gate_r]
        self._gate = mixed[..., -self.gate_rows:].contiguous()  # [s, b, np]
        return mixed[..., :-self.gate_rows], bias  # [s, b, qkv_r]

    def _apply_gate(self, module: nn.Module, args: tuple[Tensor]) -> tuple[Tensor]:
        gate, self._gate = self._gate, None
        if gate is None:
            raise RuntimeError("linear_proj ran without a gate from linear_qkv in this forward")
        return (apply_head_gate(args[0], gate),)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> ShardedStateDict:
        """megatron's sharded state, with `linear_qkv`'s weight and bias saved as [QKV; Gate]."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("weight", "bias"):
            key = f"{prefix}linear_qkv.{name}"
            if key in state:
                state[key] = qkv_gate_sharded_factory(state[key], sharded_offsets, self.gate_rows)
        return state
