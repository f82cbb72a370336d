"""Checks of a run's settings that need no model: each refuses with one line naming the key and
the fix (a `UserError`), before anything expensive happens.

`validate_train` runs first in `Trainer.__init__`, `validate_eval` first in `trainer.eval`;
`check_datasets` runs once the data is read, before the model is built.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from omegaconf import DictConfig

from ckpt.saved_config import ENV_INTERPOLATION, unresolved_env
from models.options import BuildOptions
from models.schema import ParallelConfig, head_dim_of
from models.validation import MAX_LENGTH, SettingError, check_settings
from parallel.placement import PlacementError, layout_problems, resolve_device, uses_bf16
from trainer.config import CONF_DIR, build_options, command_line_overrides
from trainer.errors import UserError
from trainer.validate_parallel import check_data_parallel, check_sequence_parallel

log = logging.getLogger(__name__)


def validate_train(cfg: DictConfig, world_size: int | None = None,
                   overrides: list[str] | None = None) -> None:
    """Everything about a training run that can be checked before the data and model exist
    (`overrides`: the command line's, when not running under Hydra)."""
    check_attention_selection(command_line_overrides() if overrides is None else overrides)
    t = cfg.trainer
    _at_least(t, "max_steps", 1)
    _at_least(t, "micro_batch_size", 1)
    _at_least(t, "global_batch_size", 1)
    _at_least(t, "seq_length", 1)
    if t.seq_length > MAX_LENGTH:
        raise UserError(f"trainer.seq_length={t.seq_length} must be at most {MAX_LENGTH}")
    _at_least(t, "log_interval", 1, "(log every N steps)")
    _at_least(t, "save_interval", 0, "(0: no periodic saves)")
    _at_least(t, "eval_interval", 0, "(0: no evaluation)")
    _at_least(t, "eval_batches", 1)
    if t.warmup_steps is not None and not 0 <= t.warmup_steps < t.max_steps:
        raise UserError(f"trainer.warmup_steps ({t.warmup_steps}) must be in [0, "
                        f"trainer.max_steps ({t.max_steps})); lower it, raise max_steps, or "
                        "leave it unset (5, fewer for a short run)")
    _check_optimizer(t)
    if t.min_lr is not None and not 0 <= t.min_lr <= t.lr:
        raise UserError(f"trainer.min_lr ({t.min_lr:g}) must be in [0, trainer.lr ({t.lr:g})]: "
                        "the decay ends at it; lower it, or leave it unset (lr / 10)")
    device, bf16 = placement(t.device, t.precision)
    check_model_values(cfg.model, cfg.attention)
    _check_micro_batches(cfg, check_layout(cfg.parallel, cfg.model.num_layers, t.seq_length,
                                           world_size))
    _check_data(cfg.data)
    check_wandb_settings(cfg)
    if cfg.eval.train_tasks:
        check_suite_settings(cfg.eval)
        p = cfg.parallel
        if p.tp != 1 or p.pp != 1 or p.cp != 1 or not t.eval_interval:
            raise UserError(f"eval.train_tasks runs the RULER suite at each eval_interval on "
                            f"the engine, which decodes whole models: it needs parallel.tp=1, "
                            f"pp=1, cp=1 (data parallelism is fine) and trainer.eval_interval > 0"
                            f" (got tp={p.tp}, pp={p.pp}, cp={p.cp}, eval_interval="
                            f"{t.eval_interval})")
    check_sequence_parallel(cfg)
    check_model(cfg.model, cfg.attention, cfg.parallel,
                build_options(t, bf16=bf16, on_gpu=device.type == "cuda"))
    check_kernel(t.attention_kernel, cuda=device.type == "cuda", head_dim=head_dim_of(cfg.model))
    _check_dca_run_settings(t, cfg.attention.kind)
    check_data_parallel(t, cfg.parallel)


def _check_dca_run_settings(t: DictConfig, kind: str) -> None:
    """DCA's own run settings (`trainer.dca_*`) changed from their defaults only with DCA."""
    if kind == "dca":
        return
    for key, default, what in (("dca_cuda_graphs", False, "replays DCA's kernels"),
                               ("dca_backward", "auto", "picks DCA's backward"),
                               ("dca_keep_rotated", False, "keeps DCA's rotations")):
        if t[key] != default:
            raise UserError(f"trainer.{key}={_shown(t[key])} {what}, but attention is "
                            f"{str(kind)!r}: add +attention=dca or drop the setting")


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_eval_source(cfg: DictConfig) -> None:
    """`trainer.eval`'s checkpoint: named, and there (its entry point checks it before Hydra
    makes the run directory and before megatron's imports)."""
    from trainer.init_from import check_load_exists

    _require_load(cfg)
    check_load_exists(cfg.checkpoint.load)


def _require_load(cfg: DictConfig) -> None:
    if not cfg.checkpoint.load:
        raise UserError("trainer.eval needs checkpoint.load=<checkpoints root or iter_* dir>")


def validate_eval(cfg: DictConfig) -> None:
    """What `trainer.eval` can check before it reads the checkpoint's model."""
    check_attention_selection(command_line_overrides())
    _check_eval_counts(cfg.eval)
    _check_max_documents(cfg.data)
    _require_load(cfg)  # its existence after the settings: open_load
    p = cfg.parallel
    if p.cp != 1 or p.pp != 1 or (p.vpp or 1) != 1:
        raise UserError(f"trainer.eval runs the model on tensor-parallel ranks alone: "
                        f"parallel.cp={p.cp}, parallel.pp={p.pp}, parallel.vpp={p.vpp}; run it "
                        "with parallel.cp=1 parallel.pp=1 parallel.vpp=null (a checkpoint saved "
                        "at any layout loads at TP alone)")
    if p.sequence_parallel:
        raise UserError("trainer.eval runs the model without sequence parallelism (decoding "
                        "feeds a token at a time): set parallel.sequence_parallel=false (a "
                        "checkpoint trained with it loads without)")
    if cfg.eval.attention_queries < 0 or (cfg.eval.attention_queries and cfg.parallel.tp > 1):
        raise UserError(f"eval.attention_queries={cfg.eval.attention_queries} needs a count >= 0 "
                        f"and parallel.tp=1 (each TP rank holds only some heads; got tp="
                        f"{cfg.parallel.tp})")
    device, _ = placement(cfg.trainer.device, cfg.trainer.precision)
    check_kernel(cfg.trainer.attention_kernel, cuda=device.type == "cuda")
    check_layout(p, None, None, None)
    check_wandb_settings(cfg)
    lengths = cfg.eval.lengths
    if lengths is not None and (not lengths or not 1 <= min(lengths) <= max(lengths) <= MAX_LENGTH):
        raise UserError(f"eval.lengths={list(lengths)}: give positive context lengths (at most "
                        f"{MAX_LENGTH})")


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
                options: BuildOptions = BuildOptions()) -> None:
    """The model's shape and attention settings: typed and in range (`models.validation`, the
    check every source of a model shares), then through the same megatron config the model
    factory builds (its ValueErrors become one-line user errors, before any tensor exists)."""
    from models.gpt import tp_problems, transformer_config

    check_model_values(model, attention)
    problems = tp_problems(model, parallel.tp)
    if problems:
        raise UserError("; ".join(problems) + ": change parallel.tp or the model")
    try:
        transformer_config(model, attention, ParallelConfig(
            tp=parallel.tp, cp=parallel.cp, sequence_parallel=parallel.sequence_parallel), options)
    except ValueError as err:
        raise UserError(f"model/attention settings: {err}") from err


def check_model_values(model: DictConfig, attention: DictConfig) -> None:
    """`models.validation.check_settings` as a user error (before any size is used: a billion
    layers hung the layout check and megatron's config)."""
    try:
        check_settings(model, attention)
    except SettingError as err:
        raise UserError(str(err)) from None


def check_wandb_settings(cfg: DictConfig) -> None:
    """wandb writes its project, entity, group, name and tags into its own files (debug.log, the
    run file): one read from the environment (`${oc.env:NAME}`) would land there resolved, so
    it is refused (the run's config goes to wandb with such values as their text)."""
    if not cfg.logger.wandb:
        return
    logger = unresolved_env(cfg)["logger"]
    for key in ("project", "entity", "group", "name", "tags"):
        value = logger.get(key)
        if any(isinstance(v, str) and ENV_INTERPOLATION.search(v)
               for v in (value if isinstance(value, list) else [value])):
            raise UserError(f"logger.{key}={value} reads the environment, and wandb writes its "
                            f"{key} into its own files (debug.log), where it would be resolved: "
                            f"give logger.{key} as text, or set logger=none")


def check_kernel(name: str, cuda: bool, head_dim: int | None = None) -> None:
    """`trainer.attention_kernel` names a kernel that runs here (an explicit fa4 needs
    FlashAttention-4 installed and an SM90+ GPU; auto falls back by itself). Logs where FA4
    leaves the model's head dim to cuDNN."""
    from models.attention.kernels import fa4_takes_head_dim, resolve

    try:
        chosen = resolve(str(name), cuda)
    except ValueError as err:
        raise UserError(str(err)) from err
    if chosen == "fa4" and head_dim is not None and not fa4_takes_head_dim(head_dim):
        log.warning("trainer.attention_kernel=%s: head_dim %d runs on cuDNN (FlashAttention-4 "
                    "serves multiples of 32 and head dims above 128; docs/benchmarks.md)", name,
                    head_dim)


def placement(device: str, precision: str) -> tuple[torch.device, bool]:
    """The run's device and whether it computes in bf16 (`parallel.placement`)."""
    try:
        chosen = resolve_device(str(device))
        return chosen, uses_bf16(str(precision), chosen)
    except PlacementError as err:
        raise UserError(str(err)) from err


def check_layout(p: DictConfig, num_layers: int | None, seq_length: int | None,
                 world_size: int | None) -> int:
    """The parallel sizes against the world size (this job's, when None), the layer count and
    the sequence length (each None: not checked); returns the data-parallel size."""
    world = world_size or (dist.get_world_size() if dist.is_initialized()
                           else int(os.environ.get("WORLD_SIZE", "1")))
    problems = layout_problems(p.tp, p.cp, p.pp, p.vpp, num_layers=num_layers,
                               seq_length=seq_length, world_size=world)
    if problems:
        raise UserError("; ".join(problems))
    return world // (p.tp * p.cp * p.pp)


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
    _check_max_documents(d)
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


def _attention_option(name: str) -> dict:
    path = Path(CONF_DIR) / "attention" / f"{name}.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _check_optimizer(t: DictConfig) -> None:
    """Adam's settings, each finite and in its range: a NaN or negative lr, a beta >= 1 or a
    negative weight decay trains wrongly without a word; a negative grad_clip turned clipping
    off."""
    _within(t, "lr", 0, low_open=True, why="(the peak learning rate)")
    _within(t, "weight_decay", 0)
    _within(t, "adam_beta1", 0, 1, high_open=True)
    _within(t, "adam_beta2", 0, 1, high_open=True)
    _within(t, "grad_clip", 0, why="(0: no clipping)")


def _check_max_documents(d: DictConfig) -> None:
    if d.max_documents is not None:
        _at_least(d, "max_documents", 1, "(or null: every document)", prefix="data")


def _check_eval_counts(e: DictConfig) -> None:
    """`trainer.eval`'s own counts and depths, before the checkpoint is read or the model runs
    (a negative count reported an empty result, a bad depth failed after the model ran)."""
    from trainer.evals.passkey import NAMES

    _at_least(e, "batch_size", 1, prefix="eval")
    _at_least(e, "passkey_trials", 1, "(trials per length and depth)", prefix="eval")
    _at_least(e, "passkey_digits", 1, "(digits of each key)", prefix="eval")
    _at_least(e, "multikey_trials", 0, "(0: skip multi-key retrieval)", prefix="eval")
    _at_least(e, "perplexity_windows", 1, "(windows of the longest length)", prefix="eval")
    if e.trained_length is not None:
        _at_least(e, "trained_length", 1, "(or null: the checkpoint's trainer.seq_length)",
                  prefix="eval")
    if not e.depths or not all(0.0 <= depth <= 1.0 for depth in e.depths):
        raise UserError(f"eval.depths={list(e.depths)}: give needle depths in [0, 1] (0: the "
                        "start of the context, 1: just before the question)")
    if e.multikey_trials > 0 and not 1 <= e.multikey_keys <= len(NAMES):
        raise UserError(f"eval.multikey_keys={e.multikey_keys} must be in [1, {len(NAMES)}] "
                        "(needles per prompt), or set eval.multikey_trials=0")
    check_suite_settings(e)


def check_suite_settings(e: DictConfig) -> None:
    """The RULER suite's settings (names, counts, format, threshold, QA file), before any
    checkpoint or model is read; the lengths are checked against each task's prompt once the
    tokenizer is known (trainer/evals/ruler_run.py)."""
    from trainer.evals.ruler.scoring import check_threshold
    from trainer.evals.ruler.suite import select_tasks

    if e.suite not in ("passkey", "ruler"):
        raise UserError(f"eval.suite={e.suite!r}: choose passkey (passkey, multi-key, "
                        "perplexity) or ruler (the RULER-style suite)")
    if e.template not in ("base", "chat", "auto"):
        raise UserError(f"eval.template={e.template!r}: choose base, chat or auto (chat when "
                        "the tokenizer has a chat template)")
    _at_least(e, "samples", 1, "(samples per task and length)", prefix="eval")
    _at_least(e, "train_samples", 1, "(samples per task and length during training)",
              prefix="eval")
    check_threshold(e.threshold)
    if e.qa_file is not None and not Path(e.qa_file).is_file():
        raise UserError(f"eval.qa_file={e.qa_file}: no such file (a SQuAD- or HotpotQA-format "
                        "JSON file)")
    if e.suite == "ruler":
        select_tasks(list(e.tasks) if e.tasks else None, e.qa_file)
    if e.train_tasks:
        select_tasks(list(e.train_tasks), e.qa_file)
    for key in ("train_lengths",):
        if e[key] is not None and (not e[key] or min(e[key]) < 1):
            raise UserError(f"eval.{key}={list(e[key])}: give positive context lengths")


def _within(node: DictConfig, key: str, low: float, high: float = math.inf, *, why: str = "",
            prefix: str = "trainer", low_open: bool = False, high_open: bool = False) -> None:
    """`node[key]` a finite number in [low, high] (an end excluded where open)."""
    value = node[key]
    ok = (value is not None and math.isfinite(value)
          and (value > low if low_open else value >= low)
          and (value < high if high_open else value <= high))
    if not ok:
        where = (f"{'>' if low_open else '>='} {low:g}" if high == math.inf else
                 f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")
        raise UserError(f"{prefix}.{key}={value} must be a finite number {where}"
                        f"{' ' + why if why else ''}")
