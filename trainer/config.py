"""Typed configuration schema of a run, registered in Hydra's ConfigStore.

The model, attention and parallel groups are `models.schema`'s dataclasses; this module adds the
run's own groups (data, trainer, checkpoint, logger, eval).

The YAML groups under `conf/` fill these dataclasses; Hydra validates every override against them,
so a misspelt key, a wrong type or a value outside a choice (every choice is a `StrEnum`) fails
at composition; `trainer.entry.check_overrides` makes that one `error:` line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from models.options import (
    MOVED_FROM_ATTENTION,
    AttentionKernel,
    BuildOptions,
    DCABackward,
    Recompute,
)
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from trainer.defaults import register_resolvers
from trainer.errors import UserError

# The installed `conf/` directory, found beside this package (both are top-level packages of the
# distribution, in a checkout, an editable or a regular install) rather than imported as the
# module `conf`: under `python -m` the working directory comes first on sys.path, and a Hydra
# project's own `conf/` there would shadow it (`pkg://conf` imports whatever `conf` wins).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

# Settings that moved out of the `attention` group (what the model is) into the `trainer` group
# (how the run runs it): the old name -> the new one (`check_moved` refuses the old one).
MOVED = {f"attention.{old}": f"trainer.{new}" for old, new in MOVED_FROM_ATTENTION.items()}


class Precision(StrEnum):
    """`trainer.precision` (parallel/placement.py's PRECISIONS)."""

    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class Device(StrEnum):
    """`trainer.device` (parallel/placement.py's DEVICES)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DecayStyle(StrEnum):
    """`trainer.lr_decay_style` (megatron's OptimizerParamScheduler)."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Suite(StrEnum):
    """`eval.suite`."""

    passkey = "passkey"
    ruler = "ruler"


class Template(StrEnum):
    """`eval.template`: the RULER prompts' format."""

    base = "base"
    chat = "chat"
    auto = "auto"


@dataclass
class DataConfig:
    """Training data: the embedded corpus (no download) or a megatron indexed dataset."""

    name: str = "embedded"  # embedded | indexed
    path: str | None = None  # indexed: the .bin/.idx prefix
    tokenizer: str = "byte"  # byte | a `tokenizers` JSON file | a Hugging Face model directory
    valid_fraction: float = 0.05
    max_documents: int | None = None
    passkey_fraction: float = 0.0  # share of training samples replaced by passkey examples
    # share replaced by multi-key examples (named needles in the sample's own text), and their
    # needle count (trainer/evals/passkey.py)
    multikey_fraction: float = 0.0
    multikey_keys: int = 4
    # read the next step's micro-batches while the GPU runs this step's backward (false: at the
    # start of each step, the GPU waiting for them)
    read_ahead: bool = True


@dataclass
class TrainerConfig:
    """Optimisation, schedule and intervals."""

    max_steps: int = 60
    micro_batch_size: int = 8
    global_batch_size: int = 8
    seq_length: int = 256
    lr: float = 3e-3
    min_lr: float | None = None  # the decay's floor; None: lr / 10 (on resume: the saved one)
    # linear warm-up steps; None: 5, fewer for a run of under 10 steps (max_steps // 2)
    warmup_steps: int | None = None
    lr_decay_style: DecayStyle = DecayStyle.cosine  # after the warm-up, down to min_lr
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    precision: Precision = Precision.auto  # auto: bf16 on GPU, fp32 on CPU
    device: Device = Device.auto  # auto: cuda when a GPU is visible, else cpu
    seed: int = 1234
    log_interval: int = 1
    eval_interval: int = 20
    eval_batches: int = 2
    save_interval: int = 20
    recompute: Recompute = Recompute.none  # activation recomputation (megatron's)
    # selective: megatron's recompute_modules (core_attn, mlp); empty: megatron's [core_attn]
    recompute_modules: list[str] = field(default_factory=list)
    recompute_num_layers: int = 0  # full: recompute only the first N layers (0: every layer)
    # full: keep each core attention's output and LSE rather than re-run it (models/recompute.py)
    recompute_keep_attention: bool = True
    fused_norm: bool = False  # RMSNorm: one Triton pass each way on the GPU (fused_rmsnorm.py)
    fused_rope: bool = False  # megatron's RoPE as one Triton pass each way (models/fused_rope.py)
    # GPU kernel of every attention kind (models/attention/kernels.py); auto: FlashAttention-4
    # on SM90+ when installed, else cudnn. Like every setting here, how the run runs the model,
    # not what the model is (a checkpoint's model record leaves it out; its run config keeps it)
    attention_kernel: AttentionKernel = AttentionKernel.auto
    # attention=dca: its forward and backward replayed as CUDA graphs, one capture per shape
    # (models/attention/dca/graphs.py): for short sequences and small chunks, where launching
    # DCA's ~100 kernels takes the host longer than the GPU needs to run them (packed documents
    # and parallel.cp > 1 run eagerly)
    dca_cuda_graphs: bool = False
    # attention=dca under FA4, where DCA's own kernels apply (models/attention/dca/dispatch.py):
    # auto (both kernels, the backward in groups of heads or pieces of query rows: attention
    # memory within ~1.15x of causal's) | one_piece (the backward in one piece: ~1% faster at
    # 32K, ~2.3x the attention's memory) | parts (the part calls both ways)
    dca_backward: DCABackward = DCABackward.auto
    # attention=dca with DCA's kernels: keep the forward's rotated queries and keys for the
    # backward instead of rotating them again (activation memory for speed: 3 copies of q and
    # one of k per layer; nothing is kept inside recomputed layers)
    dca_keep_rotated: bool = False
    # data parallelism (data-parallel x CP ranks > 1): megatron's DDP starts each gradient
    # bucket's all-reduce (reduce-scatter with parallel.distributed_optimizer) during the
    # backward, once the bucket's gradients are complete (false: all of them after it)
    overlap_grad_reduce: bool = True
    # parallel.distributed_optimizer with overlap_grad_reduce: each bucket's updated parameters
    # are gathered during the next forward, before the first layer that uses them (false: all of
    # them right after the optimizer step)
    overlap_param_gather: bool = False
    # parameters per DDP bucket with overlap_grad_reduce; None: megatron's default,
    # max(40M, 1M x data-parallel size)
    ddp_bucket_size: int | None = None


@dataclass
class CheckpointConfig:
    """Where checkpoints go and which one to resume from."""

    dir: str = "checkpoints"  # relative paths are inside the run directory
    load: str | None = None  # a checkpoints root (latest complete) or one iter_* directory
    save: bool = True
    thread_count: int = 1
    # A fresh run into a directory that holds checkpoints: remove them first (else refused).
    overwrite: bool = False
    # A resume with another lr, min_lr, warmup, decay style, weight decay or Adam betas: apply
    # them (else refused; trainer/resume.py).
    override_scheduler: bool = False


@dataclass
class LoggerConfig:
    """wandb tracking (rank 0 only). `logger=none` turns it off."""

    wandb: bool = True
    project: str = "longctx"
    entity: str | None = None
    mode: str = "offline"  # the WANDB_MODE environment variable wins when set
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    """`python -m trainer.eval`: passkey retrieval and perplexity by context length (suite
    passkey), or the RULER-style suite (suite ruler); and the suite subset run during training."""

    # passkey (passkey, multi-key, perplexity) | ruler (the RULER-style suite, trainer/evals/ruler)
    suite: Suite = Suite.passkey
    # ruler: task names (None: all 13, the QA tasks when qa_file is given), samples per task and
    # length, prompt format (base | chat | auto: chat when the tokenizer has a chat template),
    # the effective-length threshold (RULER's 85.6), a SQuAD- or HotpotQA-format JSON file
    tasks: list[str] | None = None
    samples: int = 50
    template: Template = Template.auto
    threshold: float = 85.6
    qa_file: str | None = None
    write_inputs: bool = False  # ruler: also write the prompts as ruler_inputs.jsonl
    # During training, at every trainer.eval_interval: these RULER tasks (empty: none) at
    # train_lengths (None: 2 and 4 x trainer.seq_length), train_samples each
    train_tasks: list[str] = field(default_factory=list)
    train_lengths: list[int] | None = None
    train_samples: int = 10

    # context lengths; None: the trained length T, 2T and 4T (T: trained_length or the checkpoint's)
    lengths: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_trials: int = 10  # per (length, depth) cell
    passkey_digits: int = 5
    # Multi-key retrieval in held-out corpus text (trainer/evals/retrieval.py); 0 trials: skipped
    multikey_trials: int = 10  # per (length, depth) cell
    multikey_keys: int = 4  # needles per prompt: the asked one and keys - 1 distractors
    perplexity_windows: int = 8  # windows of the longest length; shorter lengths tile the same text
    trained_length: int | None = None  # position buckets 0, T, 2T, ...; None: the checkpoint's
    # Attention entropy and mass by key distance for this many queries per length (0: off;
    # models/attention/probe.py); TP=1 only
    attention_queries: int = 0
    batch_size: int = 4
    seed: int = 0


@dataclass
class DecodeConfig:
    """The decoding engine (trainer/engine) of `trainer.generate`, `trainer.eval` and the suite
    run during training: how it runs, not what it computes."""

    # tokens per prefill forward: prompts are grouped up to it; a longer prompt is prefilled in
    # pieces of this many tokens, each attending to the cache
    prefill_tokens: int = 131072
    cuda_graphs: bool = True  # the decode step replayed as a CUDA graph (GPU only)
    # the KV cache's bound in GB (batch x length); None: half the device's memory (the GPU's,
    # or the machine's RAM on the CPU)
    max_cache_gb: float | None = None


@dataclass
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def build_options(trainer: DictConfig, *, bf16: bool, on_gpu: bool) -> BuildOptions:
    """The model factory's run options from the `trainer` group (precision and device decided by
    the caller): the one place the trainer's settings become `BuildOptions` (`run_options`: the
    part of them a forward-only model takes)."""
    return BuildOptions(
        bf16=bf16, on_gpu=on_gpu, attention_kernel=trainer.attention_kernel,
        recompute=trainer.recompute, recompute_modules=tuple(trainer.recompute_modules),
        recompute_num_layers=trainer.recompute_num_layers,
        recompute_keep_attention=trainer.recompute_keep_attention,
        fused_norm=trainer.fused_norm, fused_rope=trainer.fused_rope,
        dca_cuda_graphs=trainer.dca_cuda_graphs, dca_backward=trainer.dca_backward,
        dca_keep_rotated=trainer.dca_keep_rotated,
    )


def run_options(trainer: DictConfig, *, bf16: bool, on_gpu: bool) -> BuildOptions:
    """The options of a model that only runs forward (`trainer.eval`, `trainer.generate`): the
    `trainer` group's attention kernel, nothing of training's (recomputation, DCA's backward)."""
    return BuildOptions(bf16=bf16, on_gpu=on_gpu, attention_kernel=trainer.attention_kernel)


def register_configs() -> None:
    """Register the schema; `conf/config.yaml` names `base_config` first in its defaults."""
    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)


def command_line_overrides() -> list[str]:
    """The overrides typed on the command line of the Hydra job running now (none outside one,
    e.g. a config composed in a test)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def check_moved(overrides: list[str]) -> None:
    """Refuse a setting typed under the name it had before it moved (`MOVED`: `attention.kernel`
    is `trainer.attention_kernel`), naming the new one, before Hydra says only that the key is
    not in the attention group."""
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        if key in MOVED:
            raise UserError(moved_message(key, value or None))


def moved_message(key: str, value: str | None = None) -> str:
    new = MOVED[key]
    return (f"{key} is now {new}: how a run runs the model, not what the model is (a "
            f"checkpoint's model leaves it out); set {new}={value or '...'} instead")


def check_known_keys(cfg: DictConfig) -> None:
    """Reject keys the schema lacks. Hydra's struct mode already stops `trainer.max_stepz=3`, but
    `+trainer.max_stepz=3` appends on purpose; a training run must not ignore it silently."""
    unknown = _unknown_keys(cfg, _schema())
    moved = [key for key in unknown if key in MOVED]
    if moved:
        raise UserError(moved_message(moved[0], str(OmegaConf.select(cfg, moved[0]))))
    if unknown:
        raise UserError(f"unknown config keys: {', '.join(unknown)}; see `python -m trainer "
                         "--cfg job` for the valid ones")


@functools.cache
def _schema() -> DictConfig:
    """The typed schema, built once (only read: every key a config may have)."""
    return OmegaConf.structured(TrainConfig)


def _unknown_keys(node: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    found = []
    for key in node:
        if key not in schema:
            found.append(f"{prefix}{key}")
        elif isinstance(node[key], DictConfig) and isinstance(schema[key], DictConfig):
            found += _unknown_keys(node[key], schema[key], f"{prefix}{key}.")
    return found
