"""The two optimizer checkpoint formats megatron writes, and the way from either to the other.

Both store every optimizer state tensor as a global tensor sharded exactly as its parameter,
`optimizer.state.<name>.<parameter key>`; they differ in three places:

| | plain (`parallel.distributed_optimizer=false`) | distributed, `fully_reshardable` |
| --- | --- | --- |
| Adam moments | `exp_avg`, `exp_avg_sq` | the same |
| fp32 master weights | `fp32_param` under bf16, none under fp32 | `param`, always |
| step | `state.common_step` | each param group's `step` |
| common.pt | `{state, param_groups}` (bf16: in `optimizer`) | `optimizer.param_groups`, sharding |

So a switch renames the master weights (taking them from the model weights where the plain
format keeps none: under fp32 the two are the same tensor) and moves the step and the param
groups; megatron's own template decides every shard. Only single (unchained) optimizers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.optimizer.optimizer import param_group_identifier_keys

PLAIN, DISTRIBUTED = "plain", "distributed"
PREFIX = "optimizer.state."
# The fp32 master weights' state name in each format.
MASTER = {PLAIN: "fp32_param", DISTRIBUTED: "param"}
SHARDING_TYPE = "fully_reshardable"

Path = tuple[Any, ...]


def saved_format(common_optimizer: Any) -> str | None:
    """The format of a checkpoint's common optimizer state (None: none, or chained)."""
    if not isinstance(common_optimizer, dict):
        return None
    if "param_state_sharding_type" in common_optimizer:
        return DISTRIBUTED
    if "param_groups" in common_optimizer or "param_groups" in common_optimizer.get(
            "optimizer", {}):
        return PLAIN
    return None


def current_format(optimizer: Any) -> str:
    """The format a megatron optimizer saves in."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return DISTRIBUTED if any(hasattr(opt, "gbuf_ranges") for opt in chained) else PLAIN


def source_key(key: str, source: str, target: str, tensors: Any) -> str | None:
    """The source checkpoint's key for a target-format tensor `key`; None: the master weights
    the source format does not store (take them from the model weights)."""
    if source == target or not key.startswith(PREFIX):
        return key
    name, model_key = key[len(PREFIX):].split(".", 1)
    if name != MASTER[target]:
        return key
    renamed = f"{PREFIX}{MASTER[source]}.{model_key}"
    return renamed if renamed in tensors else None


def unread_source_keys(source: str, target: str, tensors: Any, *, master_weights: bool) -> set:
    """Source tensors a target without master weights of its own leaves unread (fp32 plain
    target: the distributed format's `param`, equal to the model weights)."""
    if source == target or master_weights:
        return set()
    prefix = f"{PREFIX}{MASTER[source]}."
    return {key for key in tensors if key.startswith(prefix)}


def retarget_template(template: Any, source: str, target: str, tensors: Any) -> list[Path]:
    """Rename the optimizer template's tensors (in place) to the source checkpoint's keys;
    entries the source lacks (fp32 master weights) are removed and returned as paths, to be
    filled from the model by `fill_from_model`."""
    holes: list[Path] = []

    def walk(node: Any, path: Path) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for name, value in list(items):
            if isinstance(value, (dict, list)):
                walk(value, path + (name,))
            elif isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                key = source_key(value.key, source, target, tensors)
                if key is None:
                    del node[name]
                    holes.append(path + (name, _place(value)))
                elif key != value.key:
                    node[name] = dataclasses.replace(value, key=key)

    walk(template, ())
    return holes


def _place(entry: ShardedTensor | ShardedTensorFactory) -> tuple[str, tuple[int, ...]]:
    """Which model tensor (or layer of a stacked one) a sharded entry stands for: its key
    without the optimizer prefix and its global offset (a factory's: its first built part's).
    An optimizer tensor has its parameter's place."""
    while isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        entry = next(iter(nested_values(built))) if isinstance(built, (dict, list)) else built
    key = entry.key
    if key.startswith(PREFIX):
        key = key[len(PREFIX):].split(".", 1)[1]
    return key, tuple(entry.global_offset)


def fill_from_model(loaded: dict, holes: list[Path], model_template: Any) -> None:
    """Put each removed master weight back as a copy of its (loaded) model parameter."""
    params = {_place(value): value.data for value in nested_values(model_template)
              if isinstance(value, (ShardedTensor, ShardedTensorFactory))}
    for *path, name, place in holes:
        node = loaded
        for step in path:
            node = node[step]
        node[name] = params[place].detach().clone()


def _step(common_optimizer: dict, source: str) -> float:
    if source == DISTRIBUTED:
        steps = {float(g["step"]) for g in common_optimizer["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise ValueError(f"the param groups hold different steps: {sorted(steps)}")
        return steps.pop()
    inner = common_optimizer.get("optimizer", common_optimizer)
    return float(inner.get("state", {}).get("common_step", 0))


def _groups(common_optimizer: dict) -> list[dict]:
    """The saved param groups' hyperparameters (no step, no parameter indices)."""
    inner = common_optimizer.get("optimizer", common_optimizer)
    return [{k: v for k, v in g.items() if k not in ("step", "params")}
            for g in inner["param_groups"]]


def convert_common(common_optimizer: dict, target: str, *, master_weights: bool) -> dict:
    """A checkpoint's common optimizer state (no tensors) in the `target` format;
    `master_weights`: a plain target keeps fp32 master weights (bf16 training)."""
    source = saved_format(common_optimizer)
    if source == target:
        return common_optimizer
    step = _step(common_optimizer, source)
    if target == DISTRIBUTED:
        out = {"optimizer": {"param_groups": [{**g, "step": step}
                                              for g in _groups(common_optimizer)]},
               "param_state_sharding_type": SHARDING_TYPE}
    else:
        inner = {"state": {"common_step": torch.tensor(step, dtype=torch.float32)},
                 "param_groups": _groups(common_optimizer)}
        out = {"optimizer": inner} if master_weights else inner
    if "grad_scaler" in common_optimizer:
        out["grad_scaler"] = common_optimizer["grad_scaler"]
    return out


def _identity(group: dict) -> tuple:
    return tuple(group.get(k) for k in param_group_identifier_keys)


def convert_loaded(loaded: dict, template: dict, common_optimizer: dict, target: str) -> dict:
    """The optimizer state dict a `target`-format optimizer loads: the loaded tensors (at the
    template's places) with the source's common state converted; `template` is the optimizer
    template the tensors were loaded into (its parameter indices, for a plain target)."""
    if target == DISTRIBUTED:
        out = convert_common(common_optimizer, target, master_weights=True)
        out["param_state"] = loaded["param_state"]
        return out
    master_weights = "fp32_from_fp16_params" in template
    out = convert_common(common_optimizer, target, master_weights=master_weights)
    inner, loaded_inner, template_inner = (
        (out["optimizer"], loaded["optimizer"], template["optimizer"]) if master_weights
        else (out, loaded, template))
    inner["state"].update({i: s for i, s in loaded_inner["state"].items() if i != "common_step"})
    saved = {_identity(g): g for g in inner["param_groups"]}
    inner["param_groups"] = [
        {**saved[_identity(g)], "params": _unwrap(g["params"])} for g in template_inner[
            "param_groups"]]
    if master_weights:
        out["fp32_from_fp16_params"] = loaded["fp32_from_fp16_params"]
    return out


def _unwrap(params: Any) -> Any:
    return params.unwrap() if isinstance(params, LocalNonpersistentObject) else params
