"""Process groups, megatron's model-parallel state and the model wrappers (kept apart from the
model code, which only builds modules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module, MegatronModule

from parallel.cpu_mode import enable_cpu_mode, end_cpu_work
from parallel.placement import Layout, PlacementError, layout_problems
from parallel.process_group import join_process_group
from parallel.torch_adam import enable_torch_adam_checkpoints


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its device, global rank, the layout of all ranks and its own
    TP, CP, DP and PP coordinates in it."""

    device: torch.device
    rank: int
    layout: Layout
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def init_process_group(device: torch.device) -> None:
    """megatron's patches for this machine, then the process group (megatron always needs one):
    torchrun's, a group of one, or the one this process already joined."""
    enable_torch_adam_checkpoints()
    if device.type == "cpu":
        enable_cpu_mode()
    join_process_group(device)


def initialize_parallel(device: torch.device, tp: int, seed: int, cp: int = 1, pp: int = 1,
                        vpp: int | None = None, distributed_optimizer: bool = False) -> Topology:
    """Process group, megatron's model-parallel groups and its RNG tracker seeds.

    Ranks are laid out in megatron's default order tp-cp-ep-dp-pp (`parallel.placement.Layout`),
    so a pipeline stage's TP groups stay on one node and stages may span nodes. Data
    parallelism takes world / (tp * cp * pp) ranks; the CP ranks and pipeline stages of one DP
    rank read the same batches. `vpp` > 1 interleaves that many model chunks per stage. The
    layers and sequence length were checked by the caller (`layout_problems`); here only the
    sizes themselves and the world.
    """
    init_process_group(device)
    world = dist.get_world_size()
    vpp = vpp if vpp and vpp > 1 else None
    problems = layout_problems(tp, cp, pp, vpp, world_size=world)
    if problems:
        raise PlacementError("; ".join(problems))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    if cp > 1:
        # NCCL creates a group's communicator at its first collective, which every member must
        # join; chunked attention's CP exchange may leave a rank with nothing to send or receive.
        dist.barrier(group=parallel_state.get_context_parallel_group())
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    layout = Layout(tp=tp, cp=cp, pp=pp, vpp=vpp or 1,
                    dp=parallel_state.get_data_parallel_world_size(),
                    distributed_optimizer=distributed_optimizer)
    return Topology(
        device=device, rank=dist.get_rank(), layout=layout,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )


def shutdown() -> None:
    """Tear down megatron's groups and the process group (tests run several jobs per process);
    on a GPU host also the CPU patches, since the process may use the GPU next."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    end_cpu_work()


def wrap_model(model: MegatronModule, *, distributed_optimizer: bool,
               disable_bucketing: bool = False, overlap_grad_reduce: bool = False,
               overlap_param_gather: bool = False,
               bucket_size: int | None = None) -> DistributedDataParallel:
    """bf16 cast (megatron's Float16Module) when configured, then megatron's DDP with fp32 grads.

    `overlap_grad_reduce`: each bucket of `bucket_size` parameters (None: megatron's default)
    starts its all-reduce (reduce-scatter with the distributed optimizer) from a backward hook
    as soon as its gradients are complete; `finalize_model_grads` waits for them.
    `overlap_param_gather` (distributed optimizer only): the updated parameter shards are
    gathered bucket by bucket from forward pre-hooks instead of after the optimizer step.
    """
    if model.config.bf16:
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size,
    )
    return DistributedDataParallel(model.config, ddp_config, model,
                                   disable_bucketing=disable_bucketing)


def wrap_chunks(chunks: list[MegatronModule], *, distributed_optimizer: bool,
                overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                bucket_size: int | None = None) -> list[DistributedDataParallel]:
    """`wrap_model` for each pipeline chunk of this rank (megatron buckets only the first). The
    overlaps apply only where there is something to reduce: more than one data-parallel (x CP)
    rank."""
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1:
        overlap_grad_reduce = overlap_param_gather = False
    return [wrap_model(chunk, distributed_optimizer=distributed_optimizer,
                       disable_bucketing=i > 0, overlap_grad_reduce=overlap_grad_reduce,
                       overlap_param_gather=overlap_param_gather, bucket_size=bucket_size)
            for i, chunk in enumerate(chunks)]


def gather_params(chunks: list[DistributedDataParallel]) -> None:
    """Under `overlap_param_gather` the distributed optimizer's updated shards reach the other
    data-parallel ranks only in the next training forward (megatron's pre-hooks): gather them
    now, before the weights are read otherwise (evaluation, decoding, a checkpoint), as
    megatron's training loop does."""
    for chunk in chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def unwrap_model(model: torch.nn.Module) -> MegatronModule:
    """The GPTModel inside DDP / Float16Module."""
    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def all_reduce_mean(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average a scalar tensor over a group (the data-parallel group for losses)."""
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)
