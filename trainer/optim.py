"""The optimizer and learning-rate schedule of a run (megatron's, configured from `trainer.*`)."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from omegaconf import DictConfig

from trainer.perf import use_fused_adam


def build_optimizer(cfg: DictConfig, chunks: list[torch.nn.Module], bf16: bool):
    """megatron's Adam (mixed precision with fp32 master weights under bf16; sharded over the
    data-parallel ranks with `parallel.distributed_optimizer`) over this rank's model chunks."""
    t = cfg.trainer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, clip_grad=t.grad_clip,
            bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        ),
        chunks,
    )
    use_fused_adam(optimizer)  # CUDA only: one pass per step instead of foreach's many
    return optimizer


def build_scheduler(cfg: DictConfig, optimizer) -> OptimizerParamScheduler:
    """Linear warm-up to `trainer.lr`, then `lr_decay_style` down to `min_lr` at `max_steps`."""
    t = cfg.trainer
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps, lr_decay_steps=t.max_steps,
        lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.max_steps, wd_incr_style="constant",
    )
