"""The training loop: build, (resume), train, evaluate, log, checkpoint."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from ckpt.disk import space_shortfall
from ckpt.load import load_checkpoint
from ckpt.meta import CheckpointMeta
from ckpt.reader import Checkpoint
from ckpt.save import save_checkpoint
from ckpt.saved_config import unresolved_env, written_settings
from models.flops import peak_tflops, training_flops_per_sequence
from models.gpt import build_model
from parallel.distributed import (
    Topology,
    gather_params,
    init_process_group,
    initialize_parallel,
    shutdown,
    wrap_chunks,
)
from trainer.config import build_options, check_known_keys
from trainer.data.datasets import DataIterator, build_datasets, validation_batches
from trainer.defaults import adopt_dca_split, degenerate_attention, resolve_schedule, set_sizes
from trainer.evals.retrieval_mix import PasskeyMix
from trainer.init_from import adopt_saved_model, open_load
from trainer.metrics import MetricsLogger
from trainer.optim import build_optimizer, build_scheduler
from trainer.resume import (
    apply_optimizer_settings,
    check_finished,
    check_resume,
    saved_run_config,
)
from trainer.run_dir import (
    RunDirError,
    check_checkpoints,
    check_writable,
    checkpoints_root,
    drop_checkpoints_after,
)
from trainer.step import train_step, validation_loss
from trainer.stop import StopOnSignal, Stopped
from trainer.validate import check_datasets, placement, validate_train

log = logging.getLogger(__name__)


def _num_microbatches(cfg: DictConfig, dp: int) -> int:
    """Micro-batches per step (`validate_train` checked that they divide evenly)."""
    t = cfg.trainer
    return t.global_batch_size // (t.micro_batch_size * dp)


def _memory_gb(device: torch.device) -> float:
    """Peak memory of the most loaded rank (rank 0 alone logs; under CP or TP another rank's
    share may be larger): CUDA peak allocated, or the process's resident set on the CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = psutil.Process().memory_info().rss / 2**30
    if dist.get_world_size() > 1:
        value = torch.tensor([peak], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        peak = value.item()
    return peak


def _from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    box = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer:
    """One training run; `run()` returns the final metrics row.

    Setup reads top-down: the process layout, the data, the model, the optimizer and schedule,
    then (when asked) the checkpoint to resume from, then logging and the data position.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        check_known_keys(cfg)
        validate_train(cfg)  # every setting checkable without data or model, first
        # A checkpoint (opened once, here) brings its model config; a model-only one is a
        # fine-tune start, any other a resume whose settings are checked against the saved
        # ones, up front.
        source = open_load(cfg.checkpoint.load) if cfg.checkpoint.load else None
        resumed = source is not None and not source.meta.model_only \
            and source.meta.run_config is not None
        # unset min_lr and warm-up: a resume keeps the saved ones
        resolve_schedule(cfg, saved_run_config(source.meta) if resumed else None)
        if source and (note := adopt_dca_split(
                cfg.attention, source.meta.attention.kind,
                (source.meta.attention.dca_chunk_size, source.meta.attention.dca_local_size),
                source.meta.seq_length, set_sizes(cfg.attention))):
            log.info(note)
        if note := degenerate_attention(cfg.attention, cfg.trainer.seq_length):
            log.warning(note)
        start = adopt_saved_model(cfg, source) if source else None
        resume_from = source if source and not start else None
        if resume_from:
            check_finished(cfg, resume_from)
            check_resume(cfg, resume_from)
        check_checkpoints(cfg, run_dir)
        check_writable(cfg, run_dir)
        self.cfg = cfg
        self.run_dir = run_dir
        self.device, self.bf16 = placement(cfg.trainer.device, cfg.trainer.precision)
        self._setup_parallel()
        tokenizer = self.tokenizer = self._setup_data()
        vocab = tokenizer.vocab_size
        self._setup_model(start.vocab_size(vocab, cfg.data.tokenizer) if start else vocab)
        # The real vocabulary and the model's origin, recorded again by this run's checkpoints.
        self.real_vocab = source.meta.vocab_size if source else vocab
        self.hf_source = source.meta.hf_source if source else None
        if start:  # before the optimizer: under bf16 it copies the weights it will step
            log.info("fine-tuning from the model-only checkpoint %s (step 0)", start.path)
            start.load(self.model)
        self.optimizer = build_optimizer(cfg, self.model, self.model_config.bf16)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self._check_space()
        self.step = 0
        self.consumed_samples = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint this run wrote
        self.saved_path: Path | None = None  # ... and its directory
        self.started = time.perf_counter()  # reset when the first step starts
        self.stop: StopOnSignal | None = None
        wandb_id = None
        if resume_from:
            wandb_id = self._resume(resume_from)
        if cfg.checkpoint.overwrite and cfg.checkpoint.save and self.topo.is_main:
            drop_checkpoints_after(checkpoints_root(cfg, run_dir), self.step)
        self.metrics = MetricsLogger(
            run_dir, enabled=self.topo.is_main, start_step=self.step, wandb_cfg=cfg.logger,
            config=unresolved_env(cfg) | {"attention_kernel": self.attention_kernel},
            wandb_id=wandb_id,
        )
        # every rank saves the same common state (megatron compares it across ranks)
        self.wandb_id = _from_rank0(self.metrics.wandb_id if self.topo.is_main else None)
        self.data: Iterator[dict[str, torch.Tensor]] = DataIterator(
            self.train_ds, cfg.trainer.micro_batch_size, cfg.trainer.seed, self.consumed_samples,
            self.topo.dp_rank, self.topo.layout.dp, mix=self.passkey_mix,
        )
        self._ahead: list[dict[str, torch.Tensor]] | None = None  # the next step's, when read

    def _check_space(self) -> None:
        """Refuse to train when one checkpoint cannot fit in `checkpoint.dir` (collective)."""
        if not self.cfg.checkpoint.save:
            return
        root = checkpoints_root(self.cfg, self.run_dir)
        # each weight, Adam's two fp32 moments and, for 16-bit weights, an fp32 master copy; every
        # model-parallel rank writes its own share
        local = sum(p.numel() * (p.element_size() + 8 + (4 if p.element_size() < 4 else 0))
                    for chunk in self.model for p in chunk.parameters())
        needed = local * self.topo.layout.tp * self.topo.layout.pp
        short = space_shortfall(root, needed)
        flag = torch.tensor([1.0 if short else 0.0], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise RunDirError(f"checkpoint.dir={root}: one checkpoint will not fit "
                              f"({short or 'on another rank'}): free space, choose another "
                              "checkpoint.dir, or set checkpoint.save=false")

    def _setup_parallel(self) -> None:
        """Process groups and megatron's parallel state; micro-batches per step."""
        t, p = self.cfg.trainer, self.cfg.parallel
        init_process_group(self.device)
        self.topo: Topology = initialize_parallel(self.device, p.tp, t.seed, p.cp, p.pp, p.vpp,
                                                  p.distributed_optimizer)
        self.micro_batches = _num_microbatches(self.cfg, self.topo.layout.dp)

    def _setup_data(self):
        """Training and validation datasets (with retrieval examples mixed in when asked)."""
        d, t = self.cfg.data, self.cfg.trainer
        self.train_ds, self.valid_ds, tokenizer = build_datasets(
            d.name, d.path, d.tokenizer, t.seq_length, d.valid_fraction, t.seed, d.max_documents)
        check_datasets(len(self.train_ds), len(self.valid_ds), self.cfg)
        self.passkey_mix = (PasskeyMix(tokenizer, d.passkey_fraction, t.seq_length, t.seed,
                                       multikey_fraction=d.multikey_fraction,
                                       keys=d.multikey_keys)
                            if d.passkey_fraction > 0 or d.multikey_fraction > 0 else None)
        return tokenizer

    def _setup_model(self, vocab_size: int) -> None:
        """The GPT from the one factory, wrapped in megatron's DDP; its FLOPs per step."""
        cfg, t = self.cfg, self.cfg.trainer
        options = build_options(t, bf16=self.bf16, on_gpu=self.device.type == "cuda")
        built = build_model(cfg.model, cfg.attention, cfg.parallel, vocab_size=vocab_size,
                            max_sequence_length=t.seq_length, options=options)
        self.model_config, self.vocab_size = built.config, built.vocab_size
        self.attention_kernel = built.attention_kernel  # resolved: names the run's metrics
        self.model = wrap_chunks(
            built.chunks, distributed_optimizer=cfg.parallel.distributed_optimizer,
            overlap_grad_reduce=t.overlap_grad_reduce,
            overlap_param_gather=t.overlap_grad_reduce and t.overlap_param_gather,
            bucket_size=t.ddp_bucket_size)
        c = built.config
        self.flops_per_step = t.global_batch_size * training_flops_per_sequence(
            num_layers=c.num_layers, hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
            kv_channels=c.kv_channels, ffn_hidden_size=c.ffn_hidden_size,
            swiglu=cfg.model.swiglu, vocab_size=built.vocab_size, seq_length=t.seq_length,
            head_wise_gate=cfg.attention.head_wise_attn_gate,
        )
        self.peak = peak_tflops(self.device)
        log.info("model %s: %.2fM parameters on this rank, attention=%s (kernel %s), %s, %s%s",
                 unresolved_env(cfg)["model"]["name"],  # never an environment value
                 sum(p.numel() for c in built.chunks for p in c.parameters()) / 1e6,
                 cfg.attention.kind + (" + head gate" if cfg.attention.head_wise_attn_gate
                                       else ""), self.attention_kernel,
                 self.topo.layout.describe(),
                 self.device.type, " bf16" if c.bf16 else " fp32")

    def _resume(self, ckpt: Checkpoint) -> str | None:
        log.info("resuming from %s", ckpt.path)
        meta = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler)
        apply_optimizer_settings(self.optimizer, self.scheduler, self.cfg)
        self.step = meta.step
        self.consumed_samples = meta.consumed_samples
        return meta.wandb_id

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over `micro_batches` micro-batches; returns (loss, grad norm)."""
        batches, self._ahead = self._ahead or self._read(), None
        loss, grad_norm = train_step(
            self.model, self.optimizer, batches, self.cfg.trainer.seq_length, self.device,
            while_gpu_busy=self._read_ahead if self.cfg.data.read_ahead else None)
        self.scheduler.step(increment=1)
        self.consumed_samples += self.cfg.trainer.global_batch_size
        return loss, grad_norm

    def _read(self) -> list[dict[str, torch.Tensor]]:
        return [next(self.data) for _ in range(self.micro_batches)]

    def _read_ahead(self) -> None:
        """The next step's micro-batches, read while the GPU works through this step's backward:
        read at the step's start they left the GPU idle (docs/benchmarks.md, host overheads)."""
        self._ahead = self._read()

    def validation_loss(self) -> float:
        gather_params(self.model)
        batches = validation_batches(self.valid_ds, self.cfg.trainer.micro_batch_size,
                                     self.cfg.trainer.eval_batches)
        return validation_loss(self.model, list(batches), self.cfg.trainer.seq_length, self.device)

    def suite_scores(self) -> dict[str, float]:
        """`eval.train_tasks` of the RULER suite on this model (trainer/evals/ruler_run.py)."""
        from trainer.evals.ruler_run import training_scores

        gather_params(self.model)
        return training_scores(self.model[0].module, self.tokenizer, self.cfg,
                               self.valid_ds.stream, self.step)

    def save(self) -> Path:
        cfg = self.cfg
        root = checkpoints_root(cfg, self.run_dir)
        meta = CheckpointMeta(  # model, attention, run_config: `${oc.env:...}` never resolved
            **written_settings(cfg), layout=self.topo.layout, seq_length=cfg.trainer.seq_length,
            vocab_size=self.real_vocab, tokenizer=str(cfg.data.tokenizer), step=self.step,
            consumed_samples=self.consumed_samples, seed=cfg.trainer.seed,
            wandb_id=self.wandb_id, hf_source=self.hf_source)
        gather_params(self.model)  # the weights of this step on every rank
        t0 = time.perf_counter()
        path = save_checkpoint(root, self.step, self.model, self.optimizer, self.scheduler, meta,
                               cfg.checkpoint.thread_count)
        log.info("saved checkpoint %s (%.1fs)", path, time.perf_counter() - t0)
        self.saved_step, self.saved_path = self.step, path
        return path

    def summary(self, steps: int) -> str:
        """The closing line: what the run did, where it left its last checkpoint, how to go on."""
        done = f"done: {steps} steps in {duration(time.perf_counter() - self.started)}"
        if self.saved_path is None:
            return f"{done}; no checkpoint saved (checkpoint.save=false)"
        root = checkpoints_root(self.cfg, self.run_dir)
        return (f"{done}; last checkpoint {self.saved_path}; resume with "
                f"checkpoint.load={root}")

    def _row(self, loss: float, grad_norm: float, seconds: float) -> dict[str, Any]:
        t = self.cfg.trainer
        tokens_per_s = t.global_batch_size * t.seq_length / seconds
        tflops = self.flops_per_step / seconds / 1e12 / self.topo.layout.world_size
        row: dict[str, Any] = {
            "step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tflops, "memory_gb": _memory_gb(self.device),
            "step_time_s": seconds, "attention_kernel": self.attention_kernel,
        }
        if self.peak:
            row["mfu"] = tflops / self.peak
        return row

    def run(self) -> dict[str, Any]:
        t = self.cfg.trainer
        log.info("training steps %d..%d, outputs in %s", self.step + 1, t.max_steps, self.run_dir)
        self.stop = StopOnSignal()  # from here on a signal ends the run with a checkpoint
        row: dict[str, Any] = {}
        first_step, self.started = self.step, time.perf_counter()
        while self.step < t.max_steps:
            if signum := self.stop.requested(self.device):
                self._stop(signum)
            start = time.perf_counter()
            loss, grad_norm = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.step += 1
            row = self._row(loss, grad_norm, time.perf_counter() - start)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.step}")
            if t.eval_interval and self.step % t.eval_interval == 0:
                row["val_loss"] = self.validation_loss()
                if self.cfg.eval.train_tasks:
                    row |= self.suite_scores()
            if self.step % t.log_interval == 0 or "val_loss" in row:
                self.metrics.log(row)
                elapsed = time.perf_counter() - self.started
                eta = elapsed / (self.step - first_step) * (t.max_steps - self.step)
                log.info(_format(row, t.max_steps, elapsed, eta, self.device.type == "cuda"))
            if self.cfg.checkpoint.save and (
                    self.step == t.max_steps
                    or (t.save_interval and self.step % t.save_interval == 0)):
                self.save()  # the last step always: a run's end is never lost
        return row

    def _stop(self, signum: int) -> None:
        """Save the current step (unless it is saved already) and raise `Stopped`."""
        stopped = Stopped(signum, self.step)
        log.warning("%s: saving before exit", stopped)
        if not self.cfg.checkpoint.save:
            log.warning("checkpoint.save=false: nothing saved; the run's steps are lost")
        elif self.saved_step != self.step:
            self.save()
        if self.saved_step is not None:
            log.warning("resume with checkpoint.load=%s", checkpoints_root(self.cfg, self.run_dir))
        raise stopped

    def close(self) -> None:
        if self.stop:
            self.stop.uninstall()
        self.metrics.finish()
        shutdown()


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _format(row: dict[str, Any], max_steps: int, elapsed: float, eta: float,
            on_gpu: bool) -> str:
    width = len(str(max_steps))
    parts = [f"step {row['step']:>{width}}/{max_steps}", f"loss {row['loss']:.4f}",
             f"lr {row['lr']:.2e}", f"gnorm {row['grad_norm']:.3f}",
             f"{row['tokens_per_s']:,.0f} tok/s"]
    if on_gpu:  # a CPU's rate is ~0.0 at this precision
        parts.append(f"{row['tflops_per_gpu']:.1f} TFLOP/s")
    if "mfu" in row:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    parts.append(f"mem {row['memory_gb']:.2f} GB")
    if "val_loss" in row:
        parts.append(f"val {row['val_loss']:.4f}")
    parts.append(f"{duration(elapsed)} elapsed, ETA {duration(eta)}")
    return " | ".join(parts)


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Build, train and tear down; returns the final metrics row."""
    try:
        trainer = Trainer(cfg, run_dir)
    except BaseException:
        shutdown()  # a refused or failed setup leaves no process groups behind
        raise
    first_step = trainer.step
    try:
        row = trainer.run()
    finally:
        trainer.close()
    log.info(trainer.summary(trainer.step - first_step))  # after wandb's closing summary
    return row
