"""The optimizer and learning-rate schedule of a run (megatron's, configured from `trainer.*`).

Without apex or Transformer Engine megatron-core falls back to `torch.optim.AdamW` in its default
multi-tensor (foreach) form: several passes over every fp32 state tensor per step. On the GPU
`use_fused_adam` switches it to torch's fused AdamW, one pass; its grad norm
and main-to-model param copy run through `parallel.multi_tensor` (no host sync per tensor).
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from omegaconf import DictConfig

from parallel import multi_tensor


def build_optimizer(cfg: DictConfig, chunks: list[torch.nn.Module], bf16: bool):
    """megatron's Adam (mixed precision with fp32 master weights under bf16; sharded over the
    data-parallel ranks with `parallel.distributed_optimizer`) over this rank's model chunks."""
    multi_tensor.install()  # megatron's apex-less grad norm syncs once per parameter tensor
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
    """Linear warm-up to `trainer.lr`, then `lr_decay_style` down to `min_lr` at `max_steps`.

    On resume the checkpoint supplies the step count and these values win (megatron's
    `override_opt_param_scheduler`): `trainer.resume` lets them differ from the saved ones only
    where that is asked for (a longer `max_steps`, `checkpoint.override_scheduler`)."""
    t = cfg.trainer
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps, lr_decay_steps=t.max_steps,
        lr_decay_style=str(t.lr_decay_style), start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.max_steps, wd_incr_style="constant",
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )


def _torch_adams(optimizer: object) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW instances inside a megatron optimizer (chained or not)."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(inner)
    return found


def use_fused_adam(optimizer: object) -> int:
    """Switch megatron's torch (Adam)W fallback to torch's fused CUDA kernel; returns how many
    torch optimizers were switched (0 where a parameter is not a CUDA float tensor, e.g. CPU)."""
    switched = 0
    for adam in _torch_adams(optimizer):
        params = [p for group in adam.param_groups for p in group["params"]]
        if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
            continue
        for group in [adam.defaults, *adam.param_groups]:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched
