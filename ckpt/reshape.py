"""`python -m ckpt reshape SRC DST --target-tp N`: rewrite a training checkpoint for TP=N.

N CPU processes (gloo) build the model at TP=N from the checkpoint's saved config, so megatron's
own `sharded_state_dict` (with every factory: SwiGLU, the head gate's [QKV; Gate]) decides each
rank's shard; the optimizer state is sharded as megatron shards it, after its parameter
(`make_sharded_optimizer_tensor`), in the dtypes stored, so no optimizer is built (megatron's
bf16 optimizer needs CUDA). The ranks load SRC into those shards and save DST in the training
format: `python -m trainer checkpoint.load=DST parallel.tp=N` resumes from it. RNG states are
per TP size, so DST has none and the resumed run starts fresh ones (as loading SRC at TP=N would).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from omegaconf import OmegaConf
from tqdm import tqdm

from ckpt.destination import add_destination_arguments, staged
from ckpt.inspect import MODEL_WEIGHT, format_table
from ckpt.layout import checked_layout, is_optimizer_key
from ckpt.load import CheckpointMismatchError, expected_entries, open_checked, template_mismatches
from ckpt.paths import resolve_checkpoint
from ckpt.reader import CHECKPOINT_HELP, Checkpoint
from ckpt.save import write_checkpoint
from ckpt.verify import compare
from models.gpt import BuildOptions, build_model, ffn_hidden_size, transformer_config
from models.schema import ParallelConfig
from parallel.cpu_mode import enable_cpu_mode
from parallel.distributed import initialize_parallel, shutdown
from parallel.lifetime import run_workers


class ReshapeError(RuntimeError):
    """The checkpoint cannot be reshaped as asked (the message says why)."""


def target_problems(ckpt: Checkpoint, tp: int) -> list[str]:
    """Everything that keeps the checkpoint's model from running at TP=`tp` (empty: it fits)."""
    if tp < 1:
        return [f"--target-tp must be at least 1 (got {tp})"]
    m = ckpt.config.model
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    ffn = ffn_hidden_size(m)
    vocab = ckpt.tensors[MODEL_WEIGHT].shape[0]
    problems = []
    if heads % tp:
        problems.append(f"model.num_attention_heads ({heads}) is not divisible by {tp}")
    if groups % tp:
        problems.append(f"model.num_query_groups ({groups}) is not divisible by {tp}: each rank "
                        "needs whole query groups (K/V heads)")
    if ffn % tp:
        problems.append(f"the MLP hidden size ({ffn}) is not divisible by {tp}")
    if vocab % tp:
        problems.append(f"the padded vocabulary ({vocab} rows) is not divisible by {tp}; the "
                        "padding is fixed in the checkpoint")
    swiglu = bool(m.swiglu)
    for info in ckpt.tensors.values():
        problem = checked_layout(info, swiglu, ckpt.tp).problem(info.key, info.shape, tp)
        if problem and not is_optimizer_key(info.key):
            problems.append(problem)
    if not problems:  # megatron's own checks, for anything the list above misses
        try:
            transformer_config(m, ckpt.config.attention, tp=tp)
        except ValueError as e:
            problems.append(str(e))
    return problems


@dataclass(frozen=True)
class PlanRow:
    key: str
    shape: tuple[int, ...]
    split: str
    old: tuple[int, ...]
    new: tuple[int, ...] | None  # None: not written (--model-only)


def plan(ckpt: Checkpoint, tp: int, model_only: bool) -> list[PlanRow]:
    """Per tensor: its TP split and one rank's local shard shape before and after."""
    swiglu = bool(ckpt.config.model.swiglu)
    rows = []
    for key, info in sorted(ckpt.tensors.items()):
        layout = checked_layout(info, swiglu, ckpt.tp)
        dropped = model_only and is_optimizer_key(key)
        rows.append(PlanRow(key, info.shape, layout.describe(),
                            layout.local_shape(info.shape, ckpt.tp),
                            None if dropped else layout.local_shape(info.shape, tp)))
    return rows


def print_plan(ckpt: Checkpoint, tp: int, rows: list[PlanRow]) -> None:
    shape = lambda s: "x".join(map(str, s))  # noqa: E731
    table = [[r.key, shape(r.shape), r.split, shape(r.old),
              "dropped (--model-only)" if r.new is None else shape(r.new)] for r in rows]
    print(format_table(table, ["key", "global shape", "TP split", f"TP={ckpt.tp} shard",
                               f"TP={tp} shard"]))
    rng = sorted({k.rsplit("/shard_", 1)[0] for k in ckpt.objects if k.startswith("rng_state/")})
    print(f"\nRNG states {', '.join(rng) or '(none)'}: not carried over (a run at TP={tp} starts "
          "fresh ones)")


def _optimizer_entries(model_sd: dict[str, Any], ckpt: Checkpoint,
                       buffers: dict[tuple[str, str], torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Sharded optimizer state as megatron builds it (after its parameter's sharding), for every
    state SRC holds for that parameter; `buffers` keeps the local tensors between calls."""
    names = sorted({key.split(".")[2] for key in ckpt.tensors if is_optimizer_key(key)})
    entries: dict[str, dict[str, Any]] = {name: {} for name in names}
    for sd_key, param in model_sd.items():
        if not isinstance(param, (ShardedTensor, ShardedTensorFactory)):
            continue  # objects (`_extra_state`) have no optimizer state
        for name in names:
            prefix = f"optimizer.state.{name}"
            probe = make_sharded_optimizer_tensor(param, param.data, prefix)
            keys = expected_entries({"probe": probe})[0]
            if not all(k in ckpt.tensors for k in keys):
                continue  # SRC has no such state for this tensor; the mismatch check reports
            if (name, sd_key) not in buffers:
                dtype = ckpt.tensors[next(iter(keys))].dtype
                buffers[name, sd_key] = torch.empty_like(param.data, dtype=dtype)
            entries[name][sd_key] = make_sharded_optimizer_tensor(param, buffers[name, sd_key],
                                                                  prefix)
    return {name: e for name, e in entries.items() if e}  # megatron keeps empty dicts in common


def _worker(rank: int, tp: int, store: str, src: str, out_root: str, model_only: bool) -> None:
    """One TP rank: build the model at TP=`tp`, load SRC into its shards, save DST."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    enable_cpu_mode()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    stages = tqdm(total=3, desc=f"reshape ({tp} ranks)", disable=rank != 0)
    try:
        ckpt = open_checked(src)  # files, CRCs and pickles: each rank checks a share
        initialize_parallel(torch.device("cpu"), tp, ckpt.config.trainer.seed)
        model = _rebuild_model(ckpt, tp)
        buffers: dict[tuple[str, str], torch.Tensor] = {}

        def template() -> dict[str, Any]:
            model_sd = model.sharded_state_dict()
            if model_only:
                return {"sharded": {"model": model_sd}}
            return {"sharded": {"model": model_sd,
                                "optimizer": _optimizer_entries(model_sd, ckpt, buffers)}}

        stages.update()
        _load_source(src, ckpt, model, template(), buffers, model_only)
        stages.update()
        write_checkpoint(out_root, ckpt.step, {**_target_common(ckpt, tp, model_only),
                                               **template()})
        stages.update()
    finally:
        stages.close()
        shutdown()


def _rebuild_model(ckpt: Checkpoint, tp: int) -> torch.nn.Module:
    """The checkpoint's model at TP=`tp` from its saved config, in the dtype it was saved in."""
    cfg = ckpt.config
    weights = ckpt.tensors[MODEL_WEIGHT]
    built = build_model(cfg.model, cfg.attention, ParallelConfig(tp=tp),
                        vocab_size=weights.shape[0], max_sequence_length=cfg.trainer.seq_length,
                        options=BuildOptions(bf16=weights.dtype == torch.bfloat16))
    if built.config.bf16:  # every parameter, norms too, as training's Float16Module casts them
        built.gpt.bfloat16()
    return built.gpt


def _load_source(src: str, ckpt: Checkpoint, model: torch.nn.Module, load: dict[str, Any],
                 buffers: dict[tuple[str, str], torch.Tensor], model_only: bool) -> None:
    """SRC's tensors into this rank's shards: the model's, and the optimizer's into `buffers`."""
    mismatches = template_mismatches(ckpt, load, with_optimizer=not model_only)
    if mismatches:
        raise CheckpointMismatchError("the model rebuilt from the saved config does not fit "
                                      "the checkpoint:\n  " + "\n  ".join(mismatches))
    loaded = dist_checkpointing.load(load, src)["sharded"]
    model.load_state_dict(loaded["model"])
    for (name, sd_key), local in buffers.items():  # factories' merged tensors are new ones
        local.copy_(loaded["optimizer"][name][sd_key])


def _target_common(ckpt: Checkpoint, tp: int, model_only: bool) -> dict[str, Any]:
    """SRC's common state (step, data position, scheduler...) with the config set to TP=`tp`.

    The sharded part is saved under its own key: megatron drops containers left empty once the
    sharded values are taken out, so common.pt is SRC's common state exactly."""
    cfg = ckpt.config
    common = {k: v for k, v in ckpt.common.items()
              if not (model_only and k in ("optimizer", "scheduler"))}
    cfg.parallel.tp = tp
    common["extra"] = {**ckpt.extra, "tp": tp, "config": OmegaConf.to_yaml(cfg),
                       "reshaped_from_tp": ckpt.tp}
    if model_only:
        common["extra"]["model_only"] = True
    return common


def reshape(src: str | Path, dst: str | Path, tp: int, *, dry_run: bool = False,
            overwrite: bool = False, model_only: bool = False, verify: bool = False) -> None:
    """Rewrite checkpoint `src` for TP=`tp` as the checkpoints root `dst`."""
    src_dir = resolve_checkpoint(src)
    ckpt = Checkpoint(src_dir)
    problems = target_problems(ckpt, tp)
    if problems:
        raise ReshapeError(f"cannot reshape {src_dir} (TP={ckpt.tp}) to TP={tp}:\n  - "
                           + "\n  - ".join(problems))
    if tp == ckpt.tp:
        raise ReshapeError(f"{src_dir} was saved at TP={tp} already; nothing to do")
    rows = plan(ckpt, tp, model_only)
    if dry_run:
        print_plan(ckpt, tp, rows)
        print(f"\ndry run: would write {Path(dst)}/{src_dir.name} (nothing written)")
        return
    dst = Path(dst)
    with staged(dst, overwrite, sources=(src_dir,)) as tmp, tempfile.TemporaryDirectory() as d:
        try:
            run_workers(_worker, (tp, f"{d}/store", str(src_dir), str(tmp), model_only), tp)
        except mp.ProcessRaisedException as e:
            raise ReshapeError(f"TP rank {e.error_index} failed:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise ReshapeError(f"TP rank {e.error_index} died (exit code {e.exit_code})") from None
        if verify:
            _verify(ckpt, Checkpoint(resolve_checkpoint(tmp)), model_only)
    print(f"wrote {dst / src_dir.name} (TP={tp}, step {ckpt.step}"
          f"{', model only' if model_only else ''})")


def _verify(src: Checkpoint, dst: Checkpoint, model_only: bool) -> None:
    """Every tensor of DST (and every model tensor of SRC) bitwise equal in both."""
    keys = set(dst.tensors) | {k for k in src.tensors if not (model_only and is_optimizer_key(k))}
    bad = [d for d in compare(src, dst, keys) if d.problem]
    if bad:
        raise ReshapeError("verification failed; nothing written:\n  "
                           + "\n  ".join(f"{d.key}: {d.problem}" for d in bad))
    models = sum(not is_optimizer_key(k) for k in keys)
    print(f"verified: {len(keys)} tensors ({models} model) bitwise equal to the source")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "reshape", help="rewrite a checkpoint for another tensor-parallel size",
        description="Rewrite a training checkpoint for TP=N: checks that the model fits TP=N "
                    "(heads, query groups, MLP size, vocabulary padding), then N CPU processes "
                    "build the model at TP=N from the saved config, load SRC and save DST, a "
                    "checkpoints root that `python -m trainer checkpoint.load=DST parallel.tp=N` "
                    "resumes from. Needs no GPU. DST appears only when complete.")
    p.add_argument("src", help=CHECKPOINT_HELP)
    add_destination_arguments(p, "the new checkpoints root")
    p.add_argument("--target-tp", type=int, required=True, metavar="N", help="the new TP size")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (each tensor's shard shape before and after) and write "
                        "nothing")
    p.add_argument("--model-only", action="store_true",
                   help="write model weights only (no optimizer or scheduler: not resumable)")
    p.add_argument("--verify", action="store_true",
                   help="reload DST and check its tensors are bitwise equal to SRC's")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    reshape(args.src, args.dst, args.target_tp, dry_run=args.dry_run, overwrite=args.overwrite,
            model_only=args.model_only, verify=args.verify)
    return 0
