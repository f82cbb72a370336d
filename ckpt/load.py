"""Load a training checkpoint, checked before any weight is touched.

A load first checks the checkpoint (`ckpt.reader`, `ckpt.checksums`): every file present and
long enough, every file's SHA-256 against the manifest written at save time (older checkpoints:
every item's CRC), every pickle parsed with an allowlist, and every tensor the model asks for
present with the model's global shape, plus the saved model settings. Only then is anything
copied into the model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from ckpt.checksums import has_manifest, missing_manifest_warning
from ckpt.meta import CheckpointMeta
from ckpt.optimizer_format import (
    DISTRIBUTED,
    convert_loaded,
    current_format,
    fill_from_model,
    retarget_template,
    saved_format,
    unread_source_keys,
)
from ckpt.reader import Checkpoint, CheckpointError
from ckpt.state import chunk_list, load_model_state, rng_key, set_rng_state, training_state
from models.gpt import transformer_config

log = logging.getLogger(__name__)

# Settings that decide the parameters; a mismatch may keep every shape (heads x head size).
ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "ffn_hidden_size", "gated_linear_unit", "normalization",
                "add_qkv_bias", "attention.head_wise_attn_gate")


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tensors do not fit the model it is loaded into (nothing was loaded)."""


Source = str | os.PathLike | Checkpoint  # a checkpoint's directory, or the checkpoint opened


def open_checked(source: Source, *, intact: bool = False) -> Checkpoint:
    """The checkpoint, checked on every rank (collective): files present and long enough, the
    checksum manifest (or, in checkpoints saved without one, the items' CRCs; each rank checks a
    share), pickles and its record (`ckpt.meta`). Raises `CheckpointError` listing every
    problem on every rank, so no rank goes on to wait for the others. `intact`: the files were
    checked already (`Checkpoint.require_intact`, before the ranks started); only the record
    is."""
    problems: list[str] = []
    ckpt = None
    ckpt_dir = source.path if isinstance(source, Checkpoint) else source
    share = (dist.get_rank(), dist.get_world_size())
    try:
        ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
        ckpt.meta  # noqa: B018 (read and checked once, here)
        if not intact:
            if share[0] == 0 and not has_manifest(ckpt.path):
                log.warning(missing_manifest_warning(ckpt.path))
            problems = ckpt.integrity_problems(share)
    except CheckpointError as e:
        problems = [str(e)]
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank_problems in everyone for p in rank_problems})
    if found or ckpt is None:
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged or unsafe to load:\n  "
                              + "\n  ".join(found))
    return ckpt


def load_checkpoint(source: Source, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any) -> CheckpointMeta:
    """Load model, optimizer, scheduler and (when saved at this TP size) RNG state; returns
    the checkpoint's record.

    Model and optimizer state reshard to the current TP size; RNG states are per TP rank and are
    restored only when the checkpoint holds them for the current TP size.
    """
    ckpt = open_checked(source)
    if optimizer is not None and ckpt.meta.model_only:
        raise CheckpointError(f"{ckpt.path} holds model weights only (written by `python -m ckpt "
                              "reshape --model-only`): there is no optimizer state to resume from")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    with_rng = any(key.startswith(rng_key(tp, pp) + "/") for key in ckpt.objects)
    template = training_state(model, optimizer, is_loading=True, with_rng=with_rng)
    switch = _FormatSwitch(ckpt, optimizer, template)
    mismatches = architecture_mismatches(ckpt, chunk_list(model)[0].config)
    mismatches += template_mismatches(ckpt, template, with_optimizer=optimizer is not None,
                                      unread=switch.unread)
    loaded = _load_if_fits(ckpt.path, template, mismatches)
    load_model_state(model, loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(switch.converted(loaded))
    if "scheduler" in loaded:  # not in model-only checkpoints
        scheduler.load_state_dict(loaded["scheduler"])
    if with_rng:
        set_rng_state(loaded["rng_state"])
    else:
        log.info("the checkpoint holds no RNG states for TP=%d PP=%d: they start fresh", tp, pp)
    return ckpt.meta


class _FormatSwitch:
    """Loading an optimizer state saved in the other format (`parallel.distributed_optimizer`
    switched): the template asks for the saved keys, and the loaded state is converted to what
    this optimizer loads (`ckpt.optimizer_format`). Does nothing when the formats agree."""

    def __init__(self, ckpt: Checkpoint, optimizer: Any, template: dict[str, Any]) -> None:
        common = ckpt.common.get("optimizer")
        self.source = saved_format(common) if optimizer is not None else None
        self.target = current_format(optimizer) if optimizer is not None else None
        self.unread: set[str] = set()
        if self.source is None or self.source == self.target:
            self.source = self.target
            return
        if len(getattr(optimizer, "chained_optimizers", [optimizer])) > 1:
            raise CheckpointError(
                f"{ckpt.path} was saved with parallel.distributed_optimizer="
                f"{str(self.source == DISTRIBUTED).lower()}; this run's optimizer is chained "
                "(several optimizers), which resumes only with the same setting")
        log.info("the checkpoint's optimizer state is in the %s format: converting it to the %s "
                 "one", self.source, self.target)
        self.common = common
        self.optimizer_template = template["optimizer"]
        self.model_template = template["model"]
        self.holes = retarget_template(template["optimizer"], self.source, self.target,
                                       ckpt.tensors)
        master_weights = (self.target == DISTRIBUTED
                          or "fp32_from_fp16_params" in template["optimizer"])
        self.unread = unread_source_keys(self.source, self.target, ckpt.tensors,
                                         master_weights=master_weights)

    def converted(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """`loaded["optimizer"]` as this run's optimizer loads it."""
        if self.source == self.target:
            return loaded["optimizer"]
        fill_from_model(loaded["optimizer"], self.holes, self.model_template)
        return convert_loaded(loaded["optimizer"], self.optimizer_template, self.common,
                              self.target)


def load_model_weights(source: Source, model: torch.nn.Module) -> CheckpointMeta:
    """Model weights only (evaluation), with `load_checkpoint`'s file and shape checks; the
    model's attention variant may differ from the saved one as long as its tensors match.
    Returns the checkpoint's record."""
    ckpt = open_checked(source)
    template = training_state(model, None, is_loading=True, with_rng=False)
    mismatches = template_mismatches(ckpt, template, with_optimizer=False)
    load_model_state(model, _load_if_fits(ckpt.path, template, mismatches)["model"])
    return ckpt.meta


# The one deliberate gap a load allows: the head gate's rows (see `load_fine_tune_start`).
_GATED = ("linear_qkv.weight", "linear_qkv.bias")


def load_fine_tune_start(source: Source, model: torch.nn.Module) -> CheckpointMeta:
    """Model weights of a model-only checkpoint (`import-hf`, `reshape --model-only`) into a model
    about to be fine-tuned; returns the checkpoint's record.

    `load_model_weights`' checks with one narrow exception: a head-gated model may start from a
    checkpoint saved without the gate (an imported model gets `+attention=head_gate`). Then, and
    only when the checkpoint holds no `._gate` tensor at all and everything else fits, each
    `linear_qkv` weight and bias loads its QKV rows from the ungated tensor and keeps its gate
    rows as the model initialised them (weight: 0.1 x the normal init; bias, when the model has
    q/k/v biases: 2.0, sigmoid = 0.88). Any other missing or misshapen tensor is refused as
    always.
    """
    ckpt = open_checked(source)
    if not ckpt.meta.model_only:
        raise CheckpointError(f"{ckpt.path} is a training checkpoint, not a model-only one: "
                              "resume from it instead")
    template = training_state(model, None, is_loading=True, with_rng=False)
    chunks = chunk_list(model)
    new_gate = (chunks[0].config.attention.head_wise_attn_gate
                and not any(key.endswith("._gate") for key in ckpt.tensors))
    if new_gate:
        def qkv_only(state: dict[str, Any]) -> dict[str, Any]:
            return {key: _qkv_only(value) if key.endswith(_GATED) else value
                    for key, value in state.items()}

        template["model"] = (qkv_only(template["model"]) if len(chunks) == 1 else
                             {name: qkv_only(state) for name, state in template["model"].items()})
        log.info("%s has no head gate: the gate rows keep their initial values", ckpt.path)
    mismatches = template_mismatches(ckpt, template, with_optimizer=False)
    load_model_state(model, _load_if_fits(ckpt.path, template, mismatches)["model"])
    return ckpt.meta


def _qkv_only(factory: Any) -> Any:
    """A head-gated `linear_qkv` factory (`qkv_gate_sharded_factory`) that loads its QKV part
    from the ungated tensor's key (same global shape and sharding) and keeps its gate part."""
    if not isinstance(factory, ShardedTensorFactory):
        return factory
    kept: list[torch.Tensor] = []

    def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> list:
        qkv, gate = factory.build_fn(key, t, replica_id, flattened_range)
        kept[:] = [gate.data.clone()]  # the model's own initial gate rows
        return [dataclasses.replace(qkv, key=key)]

    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([parts[0], kept[0]])

    return ShardedTensorFactory(factory.key, factory.data, build, merge, factory.replica_id,
                                flattened_range=factory.flattened_range)


def _load_if_fits(ckpt_dir: str | os.PathLike, template: dict[str, Any],
                  mismatches: list[str]) -> dict[str, Any]:
    """Refuse before touching any weight if the checkpoint does not fit, else load."""
    if mismatches:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} does not fit this model (nothing was loaded):\n  "
            + "\n  ".join(mismatches))
    try:
        return dist_checkpointing.load(template, str(ckpt_dir))
    except Exception as e:
        raise CheckpointError(f"loading {ckpt_dir} failed: {type(e).__name__}: {e}") from e


def architecture_mismatches(ckpt: Checkpoint, config: Any) -> list[str]:
    """Model settings that differ between the checkpoint's record and `config`."""
    try:
        saved_config = transformer_config(ckpt.meta.model, ckpt.meta.attention)
    except (AttributeError, KeyError, ValueError) as e:  # a config from another schema version
        log.warning("cannot rebuild the checkpoint's model config (%s): checking tensors only", e)
        return []
    return [f"model setting {name}: checkpoint {attrgetter(name)(saved_config)}, this model "
            f"{attrgetter(name)(config)}"
            for name in ARCHITECTURE if attrgetter(name)(saved_config) != attrgetter(name)(config)]


def template_mismatches(ckpt: Checkpoint, template: dict[str, Any], *, with_optimizer: bool,
                        unread: set[str] = frozenset()) -> list[str]:
    """Tensors and objects a load of `template` would ask for that the checkpoint lacks or holds
    at another global shape, and model (and optimizer) tensors the template would leave behind.
    Collective when several processes load: under pipeline parallelism each stage asks for its
    own tensors, and together the stages ask for every one. `unread`: checkpoint tensors that
    may stay behind (master weights another optimizer format keeps and this one does not)."""
    tensors, objects = expected_entries(template)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (tensors, objects))
        for rank_tensors, rank_objects in everyone:
            tensors.update(rank_tensors)
            objects |= rank_objects
    problems = []
    for key, shape in sorted(tensors.items()):
        info = ckpt.tensors.get(key)
        if info is None:
            problems.append(f"{key}: not in the checkpoint (the model has {list(shape)})")
        elif info.shape != shape:
            problems.append(f"{key}: checkpoint {list(info.shape)}, model {list(shape)}")
    for key in sorted(set(ckpt.tensors) - set(tensors) - unread):
        if with_optimizer or not key.startswith("optimizer."):
            problems.append(f"{key}: in the checkpoint {list(ckpt.tensors[key].shape)}, not in "
                            "the model")
    problems += [f"{key}: object not in the checkpoint"
                 for key in sorted(objects - set(ckpt.objects))]
    return problems


def expected_entries(template: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Global shapes of the tensors and keys of the objects a sharded state dict stores (its
    factories built, as megatron does when loading; the template is left as it is)."""
    tensors: dict[str, tuple[int, ...]] = {}
    objects: set[str] = set()
    pending = list(nested_values(template))
    while pending:
        value = pending.pop()
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            pending.extend(nested_values(built) if isinstance(built, (dict, list)) else [built])
        elif isinstance(value, ShardedTensor):
            tensors[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedObject):
            objects.add(value.unique_key)
    return tensors, objects
