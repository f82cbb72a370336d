"""`python -m ckpt reshape SRC DST --target-tp N --target-pp M --target-dist-opt on|off`: rewrite
a training checkpoint for another layout and optimizer format.

tp x pp CPU processes (gloo) build the model chunks of that layout from the checkpoint's saved
config, so megatron's own `sharded_state_dict` (with every factory: SwiGLU, the head gate's
[QKV; Gate], the embedding tied across the first and last stage) decides each rank's shard; the
optimizer state is sharded as megatron shards it, after its parameter
(`make_sharded_optimizer_tensor`), in the dtypes stored, so no optimizer is built (megatron's
bf16 optimizer needs CUDA). The ranks load SRC into those shards and save DST in the training
format, the optimizer state in the target's format (`ckpt.optimizer_format`):
`python -m trainer checkpoint.load=DST parallel.tp=N parallel.pp=M` resumes from it. RNG states
are per layout, so DST has none and the resumed run starts fresh ones (as loading SRC there
would). The plan and the refusals come from the index alone (`ckpt.reshape_plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from tqdm import tqdm

from ckpt.destination import staged
from ckpt.errors import ReshapeError
from ckpt.layout import is_optimizer_key, model_key
from ckpt.load import CheckpointMismatchError, expected_entries, open_checked, template_mismatches
from ckpt.optimizer_format import DISTRIBUTED, MASTER, PREFIX, convert_common
from ckpt.paths import resolve_checkpoint
from ckpt.reader import MODEL_WEIGHT, Checkpoint
from ckpt.reshape_plan import (
    PlanRow,
    has_master_weights,
    optimizer_format,
    plan,
    print_plan,
    source_layout,
    target_key,
    target_problems,
)
from ckpt.save import write_checkpoint
from ckpt.verify import bitwise_equal
from models.gpt import BuildOptions, build_model
from models.schema import ParallelConfig
from parallel.cpu_mode import enable_cpu_mode
from parallel.distributed import initialize_parallel, shutdown
from parallel.lifetime import run_workers
from parallel.placement import Layout

Buffers = dict[tuple[str, str], torch.Tensor]


def _state_names(ckpt: Checkpoint, source: Layout, target: Layout) -> dict[str, str | None]:
    """Optimizer state names at the target and the source name each is read from (None: the
    model weights, for master weights the source format does not store)."""
    master = has_master_weights(ckpt)
    names: dict[str, str | None] = {}
    for name in sorted({key.split(".")[2] for key in ckpt.tensors if is_optimizer_key(key)}):
        new = target_key(f"{PREFIX}{name}.x", source, target, master)
        if new is not None:
            names[new.split(".")[2]] = name
    if optimizer_format(target) == DISTRIBUTED and MASTER[DISTRIBUTED] not in names:
        names[MASTER[DISTRIBUTED]] = None
    return names


def _optimizer_entries(model_sd: dict[str, Any], ckpt: Checkpoint, names: dict[str, str | None],
                       buffers: Buffers, *, saving: bool) -> dict[str, dict[str, Any]]:
    """Sharded optimizer state as megatron builds it (after its parameter's sharding), under
    the source's names (`saving=False`) or the target's; `buffers` keeps the local tensors
    between calls (keyed by target name)."""
    entries: dict[str, dict[str, Any]] = {}
    for sd_key, param in model_sd.items():
        if not isinstance(param, (ShardedTensor, ShardedTensorFactory)):
            continue  # objects (`_extra_state`) have no optimizer state
        for name, source_name in names.items():
            probe = make_sharded_optimizer_tensor(param, param.data,
                                                  f"{PREFIX}{source_name or 'exp_avg'}")
            keys = expected_entries({"probe": probe})[0]
            if not all(k in ckpt.tensors for k in keys):
                continue  # SRC has no such state for this tensor; the mismatch check reports
            if (name, sd_key) not in buffers:
                dtype = (ckpt.tensors[next(iter(keys))].dtype if source_name else torch.float32)
                buffers[name, sd_key] = torch.empty_like(param.data, dtype=dtype)
            if source_name is None and not saving:
                continue  # filled from the model weights after the load
            prefix = f"{PREFIX}{name if saving else source_name}"
            entries.setdefault(name if saving else source_name, {})[sd_key] = \
                make_sharded_optimizer_tensor(param, buffers[name, sd_key], prefix)
    return entries


def _worker(rank: int, world: int, store: str, src: str, out_root: str, target: Layout,
            model_only: bool) -> None:
    """One rank of the target layout: build its model chunk, load SRC into its shards, save."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    enable_cpu_mode()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    stages = tqdm(total=3, desc=f"reshape ({world} ranks)", disable=rank != 0)
    try:
        ckpt = open_checked(src, intact=True)  # its files checked before the ranks started
        initialize_parallel(torch.device("cpu"), target.tp, ckpt.meta.seed or 0, pp=target.pp)
        model = _rebuild_model(ckpt, target)
        names = _state_names(ckpt, source_layout(ckpt), target)
        buffers: Buffers = {}

        def template(saving: bool) -> dict[str, Any]:
            model_sd = model.sharded_state_dict()
            if model_only:
                return {"sharded": {"model": model_sd}}
            return {"sharded": {"model": model_sd, "optimizer": _optimizer_entries(
                model_sd, ckpt, names, buffers, saving=saving)}}

        stages.update()
        _load_source(src, ckpt, model, template(saving=False), model_only)
        if not model_only:
            _fill_from_model(model.sharded_state_dict(), names, buffers)
        stages.update()
        write_checkpoint(out_root, ckpt.meta.step, {**_target_common(ckpt, target, model_only),
                                               **template(saving=True)})
        stages.update()
    finally:
        stages.close()
        shutdown()


def _rebuild_model(ckpt: Checkpoint, target: Layout) -> torch.nn.Module:
    """This rank's chunk of the checkpoint's model at `target` from its saved record, in the
    dtype it was saved in."""
    meta = ckpt.meta
    weights = ckpt.tensors[MODEL_WEIGHT]
    built = build_model(meta.model, meta.attention, ParallelConfig(tp=target.tp, pp=target.pp),
                        vocab_size=weights.shape[0], max_sequence_length=meta.seq_length,
                        options=BuildOptions(bf16=weights.dtype == torch.bfloat16))
    if built.config.bf16:  # every parameter, norms too, as training's Float16Module casts them
        built.gpt.bfloat16()
    return built.gpt


def _load_source(src: str, ckpt: Checkpoint, model: torch.nn.Module, load: dict[str, Any],
                 model_only: bool) -> None:
    """SRC's tensors into this rank's shards: the model's, and the optimizer's into their
    buffers (a factory's merged tensor is a new one: copied over)."""
    read = set(load["sharded"].get("optimizer", {}))
    unread = {key for key in ckpt.tensors  # e.g. the distributed optimizer's fp32 master
              if is_optimizer_key(key) and key.split(".")[2] not in read}  # weights
    mismatches = template_mismatches(ckpt, load, with_optimizer=not model_only,
                                     unread=set() if model_only else unread)
    if mismatches:
        raise CheckpointMismatchError("the model rebuilt from the saved config does not fit "
                                      "the checkpoint:\n  " + "\n  ".join(mismatches))
    loaded = dist_checkpointing.load(load, src)["sharded"]
    model.load_state_dict(loaded["model"])
    for name, entries in load["sharded"].get("optimizer", {}).items():
        for sd_key, entry in entries.items():
            value = loaded["optimizer"][name][sd_key]
            if value.data_ptr() != entry.data.data_ptr():  # loaded elsewhere
                entry.data.copy_(value)


def _fill_from_model(model_sd: dict[str, Any], names: dict[str, str | None],
                     buffers: Buffers) -> None:
    """Master weights the source format does not store: copies of the (loaded) model weights."""
    for name, source_name in names.items():
        if source_name is None:
            for sd_key, param in model_sd.items():
                if (name, sd_key) in buffers:
                    buffers[name, sd_key].copy_(param.data)


def _target_common(ckpt: Checkpoint, target: Layout, model_only: bool) -> dict[str, Any]:
    """SRC's common state (step, data position, scheduler...), the optimizer's in the target
    format, with the record's layout set to `target`.

    The sharded part is saved under its own key: megatron drops containers left empty once the
    sharded values are taken out, so common.pt is SRC's common state exactly."""
    common = {k: v for k, v in ckpt.common.items()
              if not (model_only and k in ("optimizer", "scheduler"))}
    if "optimizer" in common:
        common["optimizer"] = convert_common(common["optimizer"], optimizer_format(target),
                                             master_weights=has_master_weights(ckpt))
    meta = ckpt.meta.replace(layout=target, reshaped_from=source_layout(ckpt),
                             model_only=ckpt.meta.model_only or model_only)
    common["extra"] = meta.to_saved()
    return common


def reshape(src: str | Path, dst: str | Path, tp: int | None = None, *, pp: int | None = None,
            distributed_optimizer: bool | None = None, dry_run: bool = False,
            overwrite: bool = False, model_only: bool = False, verify: bool = False) -> None:
    """Rewrite checkpoint `src` for TP=`tp`, PP=`pp` and the optimizer format (each None: the
    source's) as the checkpoints root `dst`."""
    src_dir = resolve_checkpoint(src)
    ckpt = Checkpoint(src_dir)
    source = source_layout(ckpt)
    target = Layout(tp=source.tp if tp is None else tp, pp=source.pp if pp is None else pp,
                    distributed_optimizer=(source.distributed_optimizer
                                           if distributed_optimizer is None
                                           else distributed_optimizer))
    problems = target_problems(ckpt, target)
    if problems:
        raise ReshapeError(f"cannot reshape {src_dir} ({source.describe()}) to "
                           f"{target.describe()}: " + "; ".join(problems))
    same = dataclasses.replace(source, dp=1, cp=1, vpp=1)
    if target == same or (model_only and (target.tp, target.pp) == (same.tp, same.pp)):
        raise ReshapeError(f"{src_dir} was saved at {target.describe()} already; nothing to do")
    rows = plan(ckpt, target, model_only)
    if dry_run:
        print_plan(ckpt, target, rows)
        print(f"\ndry run: would write {Path(dst)}/{src_dir.name} (nothing written)")
        return
    ckpt.require_intact()  # a damaged source: one error line here, not a rank's traceback
    dst = Path(dst)
    world = target.tp * target.pp
    with staged(dst, overwrite, sources=(src_dir,), needs_bytes=ckpt.bytes_on_disk()) as tmp, \
            tempfile.TemporaryDirectory() as d:
        try:
            run_workers(_worker, (world, f"{d}/store", str(src_dir), str(tmp), target,
                                  model_only), world)
        except mp.ProcessRaisedException as e:
            raise ReshapeError(f"rank {e.error_index} failed:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise ReshapeError(f"rank {e.error_index} died (exit code {e.exit_code})") from None
        if verify:
            _verify(ckpt, Checkpoint(resolve_checkpoint(tmp)), rows)
    print(f"wrote {dst / src_dir.name} ({target.describe()}, step {ckpt.meta.step}"
          f"{', model only' if model_only else ''})")


def _verify(src: Checkpoint, dst: Checkpoint, rows: list[PlanRow]) -> None:
    """Every tensor of DST bitwise equal to its source (renamed optimizer state to the source's
    name, master weights added to the model weights), and DST holds nothing else."""
    pairs = {row.target_key: row.key or model_key(row.target_key) for row in rows
             if row.target_key is not None}
    bad = [f"{key}: not written" for key in sorted(set(pairs) - set(dst.tensors))]
    bad += [f"{key}: not planned" for key in sorted(set(dst.tensors) - set(pairs))]
    for key, source_key in sorted(pairs.items()):
        if key in dst.tensors:
            a, b = src.read(source_key), dst.read(key)
            if a.dtype != b.dtype:
                bad.append(f"{key}: {b.dtype}, source {source_key} {a.dtype}")
            elif not bitwise_equal(a, b):
                bad.append(f"{key}: differs from the source's {source_key}")
    if bad:
        raise ReshapeError("verification failed; nothing written:\n  " + "\n  ".join(bad))
    models = sum(not is_optimizer_key(k) for k in pairs)
    print(f"verified: {len(pairs)} tensors ({models} model) bitwise equal to the source")


def run(args: argparse.Namespace) -> int:
    reshape(args.src, args.dst, args.target_tp, pp=args.target_pp,
            distributed_optimizer=args.target_dist_opt, dry_run=args.dry_run,
            overwrite=args.overwrite, model_only=args.model_only, verify=args.verify)
    return 0
