"""What `python -m ckpt reshape` will do, from the checkpoint's index alone: the target layout
(tp, pp, optimizer format), whether the model fits it, and every tensor's shards before and after.

Ranks follow megatron's order (TP fastest, PP slowest: rank = tp_rank + tp x (cp_rank + cp x
(dp_rank + dp x pp_rank))); a pipeline stage holds a contiguous block of layers of every stacked
`decoder.layers.*` tensor, the first stage the embedding (the last one reads it too when the
output layer is tied to it), the last stage the final norm and the output layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ckpt.inspect import format_table
from ckpt.layout import TPLayout, checked_layout, is_optimizer_key, is_stacked, model_key
from ckpt.optimizer_format import DISTRIBUTED, MASTER, PLAIN, PREFIX, saved_format
from ckpt.reader import MODEL_WEIGHT, Checkpoint
from models.gpt import tp_problems, transformer_config
from models.schema import ParallelConfig
from parallel.placement import Layout, layout_problems


def optimizer_format(layout: Layout) -> str:
    """The optimizer-state format a layout's checkpoint holds (`ckpt.optimizer_format`)."""
    return DISTRIBUTED if layout.distributed_optimizer else PLAIN


def source_layout(ckpt: Checkpoint) -> Layout:
    """Where the checkpoint's tensors live; the optimizer format is the one it stores."""
    return dataclasses.replace(
        ckpt.meta.layout,
        distributed_optimizer=saved_format(ckpt.common.get("optimizer")) == DISTRIBUTED)


def target_problems(ckpt: Checkpoint, target: Layout) -> list[str]:
    """Everything that keeps the checkpoint's model from running at `target` (empty: it fits)."""
    tp, pp = target.tp, target.pp
    meta = ckpt.meta
    m = meta.model
    problems = layout_problems(tp, pp=pp, num_layers=m.num_layers, name="--target-{}".format)
    if tp < 1 or pp < 1:
        return problems  # the checks below divide by them
    vocab = ckpt.tensors[MODEL_WEIGHT].shape[0]
    problems += tp_problems(m, tp)
    if vocab % tp:
        problems.append(f"the padded vocabulary ({vocab} rows) is not divisible by {tp}; the "
                        "padding is fixed in the checkpoint")
    swiglu = m.swiglu
    # each tensor's own split, for what the model-level checks miss (their failures imply it)
    for info in [] if problems else ckpt.tensors.values():
        problem = checked_layout(info, swiglu, meta.layout.tp).problem(info.key, info.shape, tp)
        if problem and not is_optimizer_key(info.key):
            problems.append(problem)
    if target.distributed_optimizer and meta.model_only:
        problems.append("--target-dist-opt on: the checkpoint holds model weights only")
    if not problems:  # megatron's own checks, for anything the list above misses
        try:
            transformer_config(m, meta.attention, ParallelConfig(tp=tp, pp=pp))
        except ValueError as e:
            problems.append(str(e))
    return problems


def has_master_weights(ckpt: Checkpoint) -> bool:
    """Whether a plain optimizer keeps fp32 master weights for this model (bf16 weights)."""
    return ckpt.tensors[MODEL_WEIGHT].dtype != torch.float32


def target_key(key: str, source: Layout, target: Layout, master_weights: bool) -> str | None:
    """The key a source tensor is written under at `target` (None: not written: master weights
    a plain fp32 optimizer does not keep)."""
    src, dst = optimizer_format(source), optimizer_format(target)
    prefix = f"{PREFIX}{MASTER[src]}."
    if src == dst or not key.startswith(prefix):
        return key
    if dst == PLAIN and not master_weights:
        return None
    return f"{PREFIX}{MASTER[dst]}.{key[len(prefix):]}"


def added_keys(ckpt: Checkpoint, source: Layout, target: Layout) -> list[str]:
    """Target tensors the source lacks: the distributed optimizer's master weights, taken from
    the model weights of a plain fp32 optimizer's checkpoint."""
    if optimizer_format(target) != DISTRIBUTED or optimizer_format(source) == DISTRIBUTED:
        return []
    have = {model_key(k) for k in ckpt.tensors if k.startswith(f"{PREFIX}{MASTER[PLAIN]}.")}
    moments = {model_key(k) for k in ckpt.tensors if k.startswith(f"{PREFIX}exp_avg.")}
    return [f"{PREFIX}{MASTER[DISTRIBUTED]}.{k}" for k in sorted(moments - have)]


def _stages(key: str, shape: tuple[int, ...], pp: int, tied: bool) -> list[tuple[int, range]]:
    """(stage, the layers it holds) of a tensor (the layers matter for stacked tensors only)."""
    if is_stacked(key):
        per = shape[0] // pp
        return [(s, range(s * per, (s + 1) * per)) for s in range(pp)]
    name = model_key(key)
    every = range(0)
    if name.startswith("embedding."):
        return [(0, every)] + ([(pp - 1, every)] if tied and pp > 1 else [])
    if name.startswith(("decoder.final_layernorm", "output_layer")):
        return [(pp - 1, every)]
    return [(s, every) for s in range(pp)]


@dataclass(frozen=True)
class Shard:
    """One rank's part of a tensor: per axis the [start, stop) ranges it holds (several along
    SwiGLU's fused axis), and the ranks that hold it (replicas included)."""

    shape: tuple[int, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        index = ", ".join("+".join(f"{a}:{b}" for a, b in axis) for axis in self.ranges)
        return (f"{'x'.join(map(str, self.shape))} [{index}] on rank"
                f"{'s' if len(self.ranks) > 1 else ''} {','.join(map(str, self.ranks))}")


def shards(key: str, shape: tuple[int, ...], tp_layout: TPLayout, layout: Layout,
           tied: bool) -> list[Shard]:
    """Each shard of a tensor at `layout`."""
    out = []
    split = tp_layout.axis is not None
    for stage, layers in _stages(key, shape, layout.pp, tied):
        for tp_rank in range(layout.tp if split else 1):
            ranges, local = [], list(shape)
            for axis, size in enumerate(shape):
                if axis == 0 and is_stacked(key):
                    ranges.append(((layers.start, layers.stop),))
                    local[axis] = layers.stop - layers.start
                elif axis == tp_layout.axis:
                    ranges.append(tuple(tp_layout.ranges(size, layout.tp, tp_rank)))
                    local[axis] = size // layout.tp
                else:
                    ranges.append(((0, size),))
            holders = [r for t in ([tp_rank] if split else range(layout.tp))
                       for r in layout.ranks(t, stage)]
            out.append(Shard(tuple(local), tuple(ranges), tuple(holders)))
    return out


@dataclass(frozen=True)
class PlanRow:
    key: str  # the source's key ('' for a tensor only the target has)
    target_key: str | None  # None: not written
    shape: tuple[int, ...]
    split: str
    before: list[Shard]
    after: list[Shard]


def plan(ckpt: Checkpoint, target: Layout, model_only: bool) -> list[PlanRow]:
    """Per tensor: its TP split and its shards before and after."""
    source = source_layout(ckpt)
    swiglu = ckpt.meta.model.swiglu
    tied = not ckpt.meta.model.untie_embeddings
    master_weights = has_master_weights(ckpt)
    rows = []
    for key, info in sorted(ckpt.tensors.items()):
        layout = checked_layout(info, swiglu, ckpt.meta.layout.tp)
        new = None if model_only and is_optimizer_key(key) else \
            target_key(key, source, target, master_weights)
        rows.append(PlanRow(key, new, info.shape, layout.describe(),
                            shards(key, info.shape, layout, source, tied),
                            [] if new is None else shards(key, info.shape, layout, target, tied)))
    for key in ([] if model_only else added_keys(ckpt, source, target)):
        info = ckpt.tensors[model_key(key)]
        layout = checked_layout(info, swiglu, ckpt.meta.layout.tp)
        rows.append(PlanRow("", key, info.shape, layout.describe(), [],
                            shards(key, info.shape, layout, target, tied)))
    return rows


def print_plan(ckpt: Checkpoint, target: Layout, rows: list[PlanRow]) -> None:
    source = source_layout(ckpt)
    shape = lambda s: "x".join(map(str, s))  # noqa: E731
    first = lambda shards: shape(shards[0].shape) if shards else "-"  # noqa: E731
    table = [[r.key or f"(new) {r.target_key}", shape(r.shape), r.split, first(r.before),
              "not written" if r.target_key is None else first(r.after)] for r in rows]
    print(format_table(table, ["key", "global shape", "TP split",
                               f"TP={source.tp} PP={source.pp} shard",
                               f"TP={target.tp} PP={target.pp} shard"]))
    print(f"\nshards before ({source.describe()}) and after ({target.describe()}):")
    for r in rows:
        renamed = f" -> {r.target_key}" if r.key and r.target_key not in (None, r.key) else ""
        print(f"{r.key or r.target_key}{renamed}  {shape(r.shape)}")
        for when, listed in (("before", r.before), ("after", r.after)):
            if not listed:
                listed = ["(none: taken from the model weights)" if when == "before" else
                          "(not written)"]
            print(f"  {when:<6} " + "\n         ".join(map(str, listed)))
    rng = sorted({k.rsplit("/shard_", 1)[0] for k in ckpt.objects if k.startswith("rng_state/")})
    print(f"\nRNG states {', '.join(rng) or '(none)'}: not carried over (a run at TP={target.tp} "
          f"PP={target.pp} starts fresh ones)")
