"""One training step, and evaluation, through megatron's pipeline schedules.

`get_forward_backward_func()` picks the schedule for the layout: no pipelining at PP=1, 1F1B at
PP>1, interleaved 1F1B with virtual stages. Each model chunk reads the step's micro-batches in
order (every pipeline stage of a DP rank reads the same ones: the first stage needs the tokens,
the last the labels); the loss lives on the last stage and is broadcast to the others, so it is
reported once. megatron's `finalize_model_grads` ends the backward pass: the data-parallel grad
sync (waited for, when its buckets started during the backward: `trainer.overlap_grad_reduce`),
the tied embedding's grads summed over the first and last stage, sequence-parallel norms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank

from parallel.distributed import all_reduce_mean

Batch = dict[str, torch.Tensor]


def _on_this_rank(batch: Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """tokens, labels, loss mask, positions on this rank; under context parallelism (CP) pieces
    r and 2N-1-r of every sequence (the layout the CP attention and megatron's RoPE expect)."""
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    mask = batch["loss_mask"].to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    if parallel_state.get_context_parallel_world_size() > 1:
        local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "loss_mask": mask,
                                           "position_ids": positions})
        return tuple(local[k] for k in ("tokens", "labels", "loss_mask", "position_ids"))
    return tokens, labels, mask, positions


def _loss(mask: torch.Tensor, count: torch.Tensor, scale: int,
          per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """megatron's loss function: (this rank's loss sum / the micro-batch's token count, reported
    value). The schedule multiplies the first by the CP size and divides it by the number of
    micro-batches: DDP averages gradients over the dp x cp ranks, so the average is the gradient
    of the batch's mean loss. The reported value is cp x that, whose mean over the CP ranks is
    the micro-batch's mean per-token loss; `scale` divides it (the step's micro-batch count)."""
    cp = parallel_state.get_context_parallel_world_size()
    total = (per_token.float() * mask).sum()
    return total / count, {"loss": (total.detach() * cp / count) / scale}


def _forward_step(device: torch.device, scale: int, data: Iterator[Batch],
                  model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """megatron's forward_step_func: run one micro-batch through this rank's model chunk (GPTModel
    returns the per-token cross entropy on the last stage, hidden states elsewhere)."""
    tokens, labels, mask, positions = _on_this_rank(next(data), device)
    count = mask.sum()
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
    output = model(tokens, positions, None, labels=labels)
    return output, functools.partial(_loss, mask, count, scale)


def _overlap_hooks(config: Any, chunks: list[torch.nn.Module]) -> None:
    """What megatron's training loop hands its schedules when DDP overlaps the gradient
    reduction with the backward: the micro-batches before the last run under each chunk's
    `no_sync` (a bucket starts its reduction from the last one's backward, once), and the
    pipeline schedules start a chunk's remaining reductions (`start_grad_sync`) once its
    backward is done."""
    ddp_config = getattr(chunks[0], "ddp_config", None)
    if ddp_config is None or not ddp_config.overlap_grad_reduce:
        config.no_sync_func = config.grad_sync_func = None
        return
    no_sync = [chunk.no_sync for chunk in chunks]
    grad_sync = [chunk.start_grad_sync for chunk in chunks]
    config.no_sync_func = no_sync if len(chunks) > 1 else no_sync[0]
    config.grad_sync_func = grad_sync if len(chunks) > 1 else grad_sync[0]


def _run_schedule(chunks: list[torch.nn.Module], batches: list[Batch], seq_length: int,
                  device: torch.device, *, forward_only: bool, scale: int) -> torch.Tensor:
    """The schedule over `batches`; returns the sum of the reported losses on every rank of the
    pipeline (each rank's share under CP: the caller averages over the dp x cp ranks)."""
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    _overlap_hooks(config, chunks)
    data = [iter(batches) for _ in chunks]  # every chunk reads the same micro-batches in order
    outputs = get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, device, scale),
        data_iterator=data if len(chunks) > 1 else data[0], model=chunks,
        num_microbatches=len(batches), seq_length=seq_length,
        micro_batch_size=batches[0]["tokens"].shape[0], forward_only=forward_only,
    )
    total = torch.zeros((), device=device)
    for out in outputs:  # only the last stage has them
        total += out["loss"]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(total, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return total


def _mean_over_data_parallel(value: torch.Tensor) -> float:
    """Over the CP ranks too: each holds its share of the loss (see `_loss`)."""
    return all_reduce_mean(value, parallel_state.get_data_parallel_group(
        with_context_parallel=True)).item()


def train_step(chunks: list[torch.nn.Module], optimizer: Any, batches: list[Batch],
               seq_length: int, device: torch.device,
               while_gpu_busy: Callable[[], None] | None = None) -> tuple[float, float]:
    """One optimizer step over the micro-batches `batches`; returns (loss, grad norm).
    `while_gpu_busy` runs once the backward is queued: host work (reading the next batches) that
    the GPU would otherwise wait for at the next step's start."""
    for chunk in chunks:
        if not chunk.training:  # after evaluation: the recursive switch costs host time
            chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    total = _run_schedule(chunks, batches, seq_length, device, forward_only=False,
                          scale=len(batches))
    if while_gpu_busy is not None:  # the optimizer's grad norm is the step's first host sync
        while_gpu_busy()
    _, grad_norm, _ = optimizer.step()
    return _mean_over_data_parallel(total), float(grad_norm or 0.0)


@torch.no_grad()
def validation_loss(chunks: list[torch.nn.Module], batches: list[Batch], seq_length: int,
                    device: torch.device) -> float:
    """Mean per-token loss over `batches` (forward only, through the same schedule)."""
    for chunk in chunks:
        chunk.eval()
    total = _run_schedule(chunks, batches, seq_length, device, forward_only=True, scale=1)
    return _mean_over_data_parallel(total / len(batches))
