"""Checks of the parallel layout's run settings (sequence parallelism, the data-parallel
overlap), each a `UserError` of one line before anything is built."""

from __future__ import annotations

from omegaconf import DictConfig

from trainer.errors import UserError


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_sequence_parallel(cfg: DictConfig) -> None:
    """Sequence parallelism splits the sequence over the TP ranks outside attention, so each
    rank's norm weight gradient covers its slice: only the fused RMSNorm marks its weight for
    megatron's sum over the TP group (megatron's torch norms refuse it)."""
    p, t = cfg.parallel, cfg.trainer
    if not p.sequence_parallel:
        return
    if p.tp < 2:
        raise UserError(f"parallel.sequence_parallel=true splits the sequence over the "
                        f"tensor-parallel ranks: it needs parallel.tp > 1 (got {p.tp}); raise "
                        "parallel.tp or set parallel.sequence_parallel=false")
    if cfg.model.normalization != "RMSNorm" or not t.fused_norm:
        raise UserError(f"parallel.sequence_parallel=true needs trainer.fused_norm=true and "
                        f"model.normalization=RMSNorm (got fused_norm={_shown(t.fused_norm)}, "
                        f"{cfg.model.normalization}): megatron's torch norms do not sum their "
                        "weight gradients over the TP ranks; set trainer.fused_norm=true (an "
                        "RMSNorm model) or parallel.sequence_parallel=false")
    if t.seq_length % (p.tp * p.cp):
        raise UserError(f"trainer.seq_length ({t.seq_length}) must be divisible by parallel.tp x "
                        f"parallel.cp ({p.tp} x {p.cp}) under sequence parallelism: each TP "
                        "rank holds an equal slice of its CP rank's tokens")


def check_data_parallel(t: DictConfig, p: DictConfig) -> None:
    """DDP's overlap settings: the parameter gather overlaps only the distributed optimizer's
    gather, in the buckets the gradient overlap makes (megatron's own rule); a bucket size
    without the overlap would do nothing (one bucket)."""
    if t.overlap_param_gather and not (p.distributed_optimizer and t.overlap_grad_reduce):
        raise UserError(f"trainer.overlap_param_gather=true needs parallel.distributed_optimizer"
                        f"=true and trainer.overlap_grad_reduce=true (got "
                        f"{_shown(p.distributed_optimizer)}, {_shown(t.overlap_grad_reduce)}): "
                        "it overlaps the gather of the distributed optimizer's shards, bucket "
                        "by bucket; set both, or trainer.overlap_param_gather=false")
    if t.ddp_bucket_size is not None:
        if t.ddp_bucket_size < 1:
            raise UserError(f"trainer.ddp_bucket_size={t.ddp_bucket_size} must be >= 1 "
                            "(parameters per bucket, or null: megatron's default)")
        if not t.overlap_grad_reduce:
            raise UserError(f"trainer.ddp_bucket_size={t.ddp_bucket_size} applies only with "
                            "trainer.overlap_grad_reduce=true (without it every gradient is "
                            "reduced in one bucket after the backward); set it, or leave "
                            "trainer.ddp_bucket_size unset")
