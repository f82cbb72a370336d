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
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_batch_on_this_cp_rank
from omegaconf import DictConfig, OmegaConf

from models.flops import peak_tflops, training_flops_per_sequence
from models.gpt import build_gpt, padded_vocab_size, transformer_config
from trainer.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from trainer.config import check_known_keys
from trainer.data import DataIterator, build_datasets, validation_batches
from trainer.distributed import (
    Topology,
    all_reduce_mean,
    initialize_parallel,
    resolve_device,
    shutdown,
    wrap_model,
)
from trainer.metrics import MetricsLogger
from trainer.passkey import PasskeyMixDataset
from trainer.perf import use_fused_adam

log = logging.getLogger(__name__)


def _precision_is_bf16(precision: str, device: torch.device) -> bool:
    if precision == "auto":
        return device.type == "cuda"
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"trainer.precision={precision!r}: choose auto, bf16 or fp32")
    return precision == "bf16"


def _num_microbatches(cfg: DictConfig, dp: int) -> int:
    t = cfg.trainer
    if not 0 <= t.warmup_steps < t.max_steps:
        raise ValueError(f"trainer.warmup_steps ({t.warmup_steps}) must be in [0, "
                         f"trainer.max_steps ({t.max_steps}))")
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ValueError(
            f"trainer.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp})"
        )
    return t.global_batch_size // per_step


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor],
          device: torch.device) -> torch.Tensor:
    """The micro-batch's mean per-token loss; under context parallelism (CP) this rank's term.

    With CP each rank keeps pieces r and 2N-1-r of every sequence (the layout the CP attention
    and megatron's RoPE expect) and returns cp x (its loss sum) / (the whole batch's token
    count): DDP averages gradients over the dp x cp ranks, so the average is the gradient of the
    batch's mean loss, and the mean of these values over the CP ranks is that loss.
    """
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    mask = batch["loss_mask"].to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "loss_mask": mask,
                                           "position_ids": positions})
        tokens, labels, mask, positions = (local[key] for key in (
            "tokens", "labels", "loss_mask", "position_ids"))
    # GPTModel returns the per-token cross entropy when given labels: [b, s].
    per_token = model(tokens, positions, None, labels=labels)
    count = mask.sum()
    if cp > 1:
        dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
    return (per_token.float() * mask).sum() * cp / count


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


class Trainer:
    """One training run; `run()` returns the final metrics row."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        check_known_keys(cfg)
        self.cfg = cfg
        self.run_dir = run_dir
        t = cfg.trainer
        self.device = resolve_device(t.device)
        if t.seq_length % (2 * cfg.parallel.cp):
            raise ValueError(f"trainer.seq_length ({t.seq_length}) must be divisible by 2 x "
                             f"parallel.cp ({cfg.parallel.cp}): each CP rank holds two pieces")
        self.topo: Topology = initialize_parallel(self.device, cfg.parallel.tp, t.seed,
                                                  cfg.parallel.cp)
        self.micro_batches = _num_microbatches(cfg, self.topo.dp)

        self.train_ds, self.valid_ds, tokenizer = build_datasets(
            cfg.data.name, cfg.data.path, cfg.data.tokenizer, t.seq_length,
            cfg.data.valid_fraction, t.seed, cfg.data.max_documents,
        )
        if cfg.data.passkey_fraction > 0:
            self.train_ds = PasskeyMixDataset(self.train_ds, tokenizer, cfg.data.passkey_fraction,
                                              t.seq_length, t.seed)
        self.vocab_size = padded_vocab_size(tokenizer.vocab_size,
                                            cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
        bf16 = _precision_is_bf16(t.precision, self.device)
        self.model_config = transformer_config(
            cfg.model, cfg.attention, tp=cfg.parallel.tp, cp=cfg.parallel.cp,
            sequence_parallel=cfg.parallel.sequence_parallel, bf16=bf16,
            on_gpu=self.device.type == "cuda", recompute=t.recompute,
            recompute_modules=t.recompute_modules, recompute_num_layers=t.recompute_num_layers,
            recompute_keep_attention=t.recompute_keep_attention, fused_norm=t.fused_norm,
        )
        gpt = build_gpt(self.model_config, self.vocab_size, t.seq_length,
                        cfg.model.untie_embeddings)
        if self.device.type == "cuda":
            gpt.cuda()
        self.model = wrap_model(gpt, distributed_optimizer=cfg.parallel.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, clip_grad=t.grad_clip,
                bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            ),
            [self.model],
        )
        use_fused_adam(self.optimizer)  # CUDA only: one pass per step instead of foreach's many
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=t.warmup_steps, lr_decay_steps=t.max_steps,
            lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=t.max_steps, wd_incr_style="constant",
        )
        self.flops_per_step = t.global_batch_size * training_flops_per_sequence(
            num_layers=self.model_config.num_layers, hidden_size=self.model_config.hidden_size,
            num_attention_heads=self.model_config.num_attention_heads,
            num_query_groups=self.model_config.num_query_groups,
            kv_channels=self.model_config.kv_channels,
            ffn_hidden_size=self.model_config.ffn_hidden_size, swiglu=cfg.model.swiglu,
            vocab_size=self.vocab_size, seq_length=t.seq_length,
            head_wise_gate=cfg.attention.head_wise_attn_gate,
        )
        self.peak = peak_tflops(self.device)
        self.step = 0
        self.consumed_samples = 0
        wandb_id = None
        if cfg.checkpoint.load:
            wandb_id = self._resume(cfg.checkpoint.load)
        self.metrics = MetricsLogger(
            run_dir, enabled=self.topo.is_main, start_step=self.step, wandb_cfg=cfg.logger,
            config=OmegaConf.to_container(cfg, resolve=True), wandb_id=wandb_id,
        )
        self.data: Iterator[dict[str, torch.Tensor]] = DataIterator(
            self.train_ds, t.micro_batch_size, t.seed, self.consumed_samples,
            self.topo.dp_rank, self.topo.dp,
        )
        n_params = sum(p.numel() for p in gpt.parameters())
        log.info("model %s: %.2fM parameters on this rank, attention=%s, tp=%d cp=%d dp=%d, %s%s",
                 cfg.model.name, n_params / 1e6, cfg.attention.kind, self.topo.tp, self.topo.cp,
                 self.topo.dp, self.device.type, " bf16" if bf16 else " fp32")

    def _resume(self, path: str) -> str | None:
        ckpt = resolve_checkpoint(path)
        log.info("resuming from %s", ckpt)
        extra = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler)
        self.step = extra["step"]
        self.consumed_samples = extra["consumed_samples"]
        return extra.get("wandb_id")

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over `micro_batches` micro-batches; returns (loss, grad norm)."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = torch.zeros((), device=self.device)
        for _ in range(self.micro_batches):
            loss = _loss(self.model, next(self.data), self.device) / self.micro_batches
            loss.backward()
            total += loss.detach()
        self.model.finish_grad_sync()
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.consumed_samples += self.cfg.trainer.global_batch_size
        # Over the CP ranks too: each holds its share of the loss (see _loss).
        loss = all_reduce_mean(total, parallel_state.get_data_parallel_group(
            with_context_parallel=True))
        return loss.item(), float(grad_norm or 0.0)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        batches = validation_batches(self.valid_ds, self.cfg.trainer.micro_batch_size,
                                     self.cfg.trainer.eval_batches)
        losses = torch.stack([_loss(self.model, b, self.device) for b in batches])
        return all_reduce_mean(losses.mean(), parallel_state.get_data_parallel_group(
            with_context_parallel=True)).item()

    def save(self) -> Path:
        root = Path(self.cfg.checkpoint.dir)
        if not root.is_absolute():
            root = self.run_dir / root
        extra = {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "tp": self.topo.tp,
            "config": OmegaConf.to_yaml(self.cfg, resolve=True),
            "wandb_id": self.metrics.wandb_id,
        }
        t0 = time.perf_counter()
        path = save_checkpoint(root, self.step, self.model, self.optimizer, self.scheduler, extra,
                               self.cfg.checkpoint.thread_count)
        log.info("saved checkpoint %s (%.1fs)", path, time.perf_counter() - t0)
        return path

    def _row(self, loss: float, grad_norm: float, seconds: float) -> dict[str, Any]:
        t = self.cfg.trainer
        tokens_per_s = t.global_batch_size * t.seq_length / seconds
        tflops = self.flops_per_step / seconds / 1e12 / self.topo.world_size
        row: dict[str, Any] = {
            "step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tflops, "memory_gb": _memory_gb(self.device),
            "step_time_s": seconds,
        }
        if self.peak:
            row["mfu"] = tflops / self.peak
        return row

    def run(self) -> dict[str, Any]:
        t = self.cfg.trainer
        log.info("training steps %d..%d, outputs in %s", self.step + 1, t.max_steps, self.run_dir)
        row: dict[str, Any] = {}
        while self.step < t.max_steps:
            start = time.perf_counter()
            loss, grad_norm = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.step += 1
            row = self._row(loss, grad_norm, time.perf_counter() - start)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.step}")
            if t.eval_interval and self.step % t.eval_interval == 0:
                row["val_loss"] = self.evaluate()
            if self.step % t.log_interval == 0 or "val_loss" in row:
                self.metrics.log(row)
                log.info(_format(row))
            if self.cfg.checkpoint.save and t.save_interval and self.step % t.save_interval == 0:
                self.save()
        return row

    def close(self) -> None:
        self.metrics.finish()
        shutdown()


def _format(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']:>5}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}",
             f"gnorm {row['grad_norm']:.3f}", f"{row['tokens_per_s']:,.0f} tok/s",
             f"{row['tflops_per_gpu']:.1f} TFLOP/s"]
    if "mfu" in row:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    parts.append(f"mem {row['memory_gb']:.2f} GB")
    if "val_loss" in row:
        parts.append(f"val {row['val_loss']:.4f}")
    return " | ".join(parts)


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Build, train and tear down; returns the final metrics row."""
    trainer = Trainer(cfg, run_dir)
    try:
        return trainer.run()
    finally:
        trainer.close()
