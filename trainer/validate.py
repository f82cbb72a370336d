"""Checks of a run's settings that need no model: each refuses with one line naming the key and
the fix (a `UserError`), before anything expensive happens.

`validate_train` runs first in `Trainer.__init__`, `validate_eval` first in `trainer.eval`;
`check_datasets` runs once the data is read, before the model is built.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from omegaconf import DictConfig

from trainer.config import CONF_DIR
from trainer.errors import UserError

_KINDS = ("auto", "cpu", "cuda")


def validate_train(cfg: DictConfig, world_size: int | None = None,
                   overrides: list[str] | None = None) -> None:
    """Everything about a training run that can be checked before the data and model exist
    (`overrides`: the command line's, when not running under Hydra)."""
    check_attention_selection(_hydra_overrides() if overrides is None else overrides)
    t = cfg.trainer
    _at_least(t, "max_steps", 1)
    _at_least(t, "micro_batch_size", 1)
    _at_least(t, "global_batch_size", 1)
    _at_least(t, "seq_length", 1)
    _at_least(t, "log_interval", 1, "(log every N steps)")
    _at_least(t, "save_interval", 0, "(0: no periodic saves)")
    _at_least(t, "eval_interval", 0, "(0: no evaluation)")
    _at_least(t, "eval_batches", 1)
    if t.warmup_steps is not None and not 0 <= t.warmup_steps < t.max_steps:
        raise UserError(f"trainer.warmup_steps ({t.warmup_steps}) must be in [0, "
                        f"trainer.max_steps ({t.max_steps})); lower it, raise max_steps, or "
                        "leave it unset (5, fewer for a short run)")
    if not t.lr > 0:
        raise UserError(f"trainer.lr={t.lr} must be > 0")
    if t.min_lr is not None and not 0 <= t.min_lr <= t.lr:
        raise UserError(f"trainer.min_lr ({t.min_lr:g}) must be in [0, trainer.lr ({t.lr:g})]: "
                        "the decay ends at it; lower it, or leave it unset (lr / 10)")
    if t.precision not in ("auto", "bf16", "fp32"):
        raise UserError(f"trainer.precision={t.precision!r}: choose auto, bf16 or fp32")
    device = _device_type(t.device)
    _check_micro_batches(cfg, _check_parallel(cfg.parallel, cfg.model.num_layers,
                                              t.seq_length, world_size))
    _check_data(cfg.data)
    bf16 = t.precision == "bf16" or (t.precision == "auto" and device == "cuda")
    check_model(cfg.model, cfg.attention, cfg.parallel, bf16=bf16, on_gpu=device == "cuda",
                recompute=t.recompute, recompute_modules=tuple(t.recompute_modules),
                recompute_num_layers=t.recompute_num_layers,
                recompute_keep_attention=t.recompute_keep_attention, fused_norm=t.fused_norm,
                fused_rope=t.fused_rope)
    if t.dca_cuda_graphs and cfg.attention.kind != "dca":
        raise UserError(f"trainer.dca_cuda_graphs=true replays DCA's kernels, but attention is "
                        f"{cfg.attention.kind!r}: add +attention=dca or drop the setting")
    if cfg.checkpoint.load:
        check_checkpoint_load(cfg.checkpoint.load)


def validate_eval(cfg: DictConfig) -> None:
    """What `trainer.eval` can check before it reads the checkpoint's model."""
    check_attention_selection(_hydra_overrides())
    if not cfg.checkpoint.load:
        raise UserError("trainer.eval needs checkpoint.load=<checkpoints root or iter_* dir>")
    if cfg.parallel.cp != 1:
        raise UserError(f"trainer.eval does not split sequences across ranks: parallel.cp="
                        f"{cfg.parallel.cp}; run it with parallel.cp=1 (a checkpoint trained "
                        "with CP loads at CP=1; eval needs no activations for backward)")
    if cfg.eval.attention_queries < 0 or (cfg.eval.attention_queries and cfg.parallel.tp > 1):
        raise UserError(f"eval.attention_queries={cfg.eval.attention_queries} needs a count >= 0 "
                        f"and parallel.tp=1 (each TP rank holds only some heads; got tp="
                        f"{cfg.parallel.tp})")
    _check_parallel(cfg.parallel, 2, _device_type(cfg.trainer.device), None)
    if cfg.eval.lengths is not None and (not cfg.eval.lengths or min(cfg.eval.lengths) < 1):
        raise UserError(f"eval.lengths={list(cfg.eval.lengths)}: give positive context lengths")
    check_checkpoint_load(cfg.checkpoint.load)


def check_datasets(train_len: int, valid_len: int, cfg: DictConfig) -> None:
    """The training set must hold a sample; so must the validation set when the run evaluates."""
    seq = cfg.trainer.seq_length
    if train_len == 0:
        raise UserError(f"data: no training sample of trainer.seq_length + 1 = {seq + 1} tokens "
                        "(the corpus is too small); lower trainer.seq_length or add data")
    if cfg.trainer.eval_interval > 0 and valid_len == 0:
        raise UserError(
            f"data: the validation set holds no sample of {seq + 1} tokens (data.valid_fraction="
            f"{cfg.data.valid_fraction}); raise data.valid_fraction, add documents, lower "
            "trainer.seq_length, or set trainer.eval_interval=0 to train without evaluation")


def check_attention_selection(overrides: list[str]) -> None:
    """At most one core-attention kind among the `attention` group options on the command line
    (`'+attention=[dca,chunked]'` would otherwise merge both and let the last kind win)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    chosen: list[str] = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.key_or_group != "attention" or override.package or override.is_delete():
            continue
        value = override.value()
        names = value if isinstance(value, list) else [value]
        chosen += [str(n) for n in names if "kind" in _attention_option(str(n))]
    if len(chosen) > 1:
        raise UserError(f"attention: {' and '.join(chosen)} are two core-attention kinds; "
                        "select one (+attention=<kind>), optionally with head_gate, e.g. "
                        f"'+attention=[{chosen[0]},head_gate]'")


def check_model(model: DictConfig, attention: DictConfig, parallel: DictConfig,
                **options: object) -> None:
    """The model's shape and attention settings, through the same megatron config the model
    factory builds (its ValueErrors become one-line user errors, before any tensor exists)."""
    from models.gpt import tp_problems, transformer_config

    _at_least(model, "num_layers", 1, prefix="model")
    _at_least(model, "hidden_size", 1, prefix="model")
    _at_least(model, "num_attention_heads", 1, prefix="model")
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    if groups < 1 or heads % groups:
        raise UserError(f"model.num_attention_heads ({heads}) must be divisible by "
                        f"model.num_query_groups ({groups}): every query group serves the same "
                        "number of heads; choose a num_query_groups that divides the head count")
    if model.kv_channels is None and model.hidden_size % heads:
        raise UserError(f"model.hidden_size ({model.hidden_size}) must be divisible by "
                        f"model.num_attention_heads ({heads}), or set model.kv_channels")
    head_dim = model.kv_channels or model.hidden_size // heads
    if head_dim % 2:
        raise UserError(f"the head dimension ({head_dim}) must be even: RoPE rotates pairs of "
                        "channels; change model.hidden_size, num_attention_heads or kv_channels")
    problems = tp_problems(model, parallel.tp)
    if problems:
        raise UserError("; ".join(problems) + ": change parallel.tp or the model")
    try:
        transformer_config(model, attention, tp=parallel.tp, cp=parallel.cp,
                           sequence_parallel=parallel.sequence_parallel, **options)
    except ValueError as err:
        raise UserError(f"model/attention settings: {err}") from err


def check_checkpoint_load(path: str) -> None:
    """`checkpoint.load` names an existing checkpoints root or a complete iter_* directory."""
    from ckpt.paths import resolve_checkpoint
    from ckpt.reader import CheckpointError

    if not Path(path).exists():
        raise UserError(f"checkpoint.load={path}: no such file or directory; give a checkpoints "
                        "root (e.g. outputs/<date>/<time>/checkpoints) or one iter_* directory")
    try:
        resolve_checkpoint(path)
    except (FileNotFoundError, CheckpointError) as err:
        raise UserError(f"checkpoint.load={path}: {err}") from err


def _check_parallel(p: DictConfig, num_layers: int, seq_length: int,
                    world_size: int | None) -> int:
    """TP/CP/PP/VPP sizes against the world size, layer count and sequence length; returns the
    data-parallel size."""
    for key in ("tp", "cp", "pp"):
        _at_least(p, key, 1, prefix="parallel")
    vpp = p.vpp or 1
    if vpp < 1:
        raise UserError(f"parallel.vpp={p.vpp} must be at least 1 (or null: no interleaving)")
    if vpp > 1 and p.pp == 1:
        raise UserError(f"parallel.vpp={vpp} interleaves pipeline stages: it needs "
                        "parallel.pp > 1 (or set parallel.vpp=null)")
    if num_layers % (p.pp * vpp):
        raise UserError(f"model.num_layers ({num_layers}) must be divisible by parallel.pp x "
                        f"parallel.vpp ({p.pp} x {vpp}): every stage holds as many layers")
    # Only context parallelism cares about parity: each CP rank holds pieces r and 2N-1-r of
    # every sequence (load balance for causal attention). Without CP any length works.
    if p.cp > 1 and seq_length % (2 * p.cp):
        raise UserError(f"trainer.seq_length ({seq_length}) must be divisible by 2 x parallel.cp "
                        f"({p.cp}): each CP rank holds two of the 2 x cp pieces of a sequence")
    world = world_size or (dist.get_world_size() if dist.is_initialized()
                           else int(os.environ.get("WORLD_SIZE", "1")))
    model_parallel = p.tp * p.cp * p.pp
    if world % model_parallel:
        raise UserError(f"the number of processes ({world}) must be a multiple of parallel.tp x "
                        f"parallel.cp x parallel.pp ({p.tp} x {p.cp} x {p.pp}); the rest is data "
                        "parallelism: change them or torchrun's --nproc-per-node")
    return world // model_parallel


def _check_micro_batches(cfg: DictConfig, dp: int) -> None:
    """The step's micro-batch count: whole, and a multiple of PP under interleaving (megatron's
    interleaved schedule runs micro-batches in groups of pp)."""
    t, p = cfg.trainer, cfg.parallel
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise UserError(
            f"trainer.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"trainer.micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp}); "
            "change one of them")
    if not p.vpp or p.vpp == 1:
        return
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    if micro % p.pp:
        raise UserError(f"interleaved pipelining (parallel.vpp={p.vpp}) needs a multiple of "
                        f"parallel.pp ({p.pp}) micro-batches per step, got {micro} (= "
                        "trainer.global_batch_size / (micro_batch_size x data-parallel size))")
    if t.eval_interval and t.eval_batches % p.pp:
        raise UserError(f"interleaved pipelining (parallel.vpp={p.vpp}) needs "
                        f"trainer.eval_batches ({t.eval_batches}) to be a multiple of "
                        f"parallel.pp ({p.pp})")


def _check_data(d: DictConfig) -> None:
    if d.name not in ("embedded", "indexed"):
        raise UserError(f"data.name={d.name!r}: choose embedded or indexed (data=indexed)")
    if not 0.0 <= d.valid_fraction < 1.0:
        raise UserError(f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    if d.name == "indexed":
        if not d.path:
            raise UserError("data=indexed needs data.path=<prefix of the .bin/.idx files>")
        missing = [f"{d.path}{ext}" for ext in (".bin", ".idx") if not Path(f"{d.path}{ext}")
                   .is_file()]
        if missing:
            raise UserError(f"data.path={d.path}: {', '.join(missing)} not found; build it with "
                            "`python -m trainer.build_data`")
    tokenizer = Path(d.tokenizer)
    if d.tokenizer != "byte" and not (tokenizer.is_file()
                                      or (tokenizer / "tokenizer.json").is_file()):
        raise UserError(f"data.tokenizer={d.tokenizer}: no such file; give 'byte', a "
                        "`tokenizers` JSON file or a Hugging Face model directory holding "
                        "tokenizer.json")


def _at_least(node: DictConfig, key: str, low: int, why: str = "", prefix: str = "trainer"
              ) -> None:
    value = node[key]
    if value is None or value < low:
        raise UserError(f"{prefix}.{key}={value} must be >= {low}{' ' + why if why else ''}")


def _device_type(choice: str) -> str:
    if choice not in _KINDS:
        raise UserError(f"trainer.device={choice!r}: choose auto, cpu or cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    return "cuda" if choice == "cuda" or torch.cuda.is_available() and choice == "auto" else "cpu"


def _attention_option(name: str) -> dict:
    path = Path(CONF_DIR) / "attention" / f"{name}.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _hydra_overrides() -> list[str]:
    """The command line's overrides when running under Hydra (none when called directly)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
