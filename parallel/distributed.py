"""Process groups, megatron's model-parallel state and the model wrappers (kept apart from the
model code, which only builds modules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module, MegatronModule

from parallel.cpu_mode import enable_cpu_mode
from parallel.process_group import join_process_group
from parallel.torch_adam import enable_torch_adam_checkpoints


@dataclass(frozen=True)
class Topology:
    """Where this process sits: global rank and world, its TP, CP, DP and PP coordinates."""

    device: torch.device
    rank: int
    world_size: int
    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    cp: int
    cp_rank: int
    pp: int = 1
    pp_rank: int = 0
    vpp: int = 1  # model chunks per pipeline stage

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_process_group(device: torch.device) -> None:
    """megatron's patches for this machine, then the process group (megatron always needs one):
    torchrun's, a group of one, or the one this process already joined."""
    enable_torch_adam_checkpoints()
    if device.type == "cpu":
        enable_cpu_mode()
    join_process_group(device)


def initialize_parallel(device: torch.device, tp: int, seed: int, cp: int = 1, pp: int = 1,
                        vpp: int | None = None) -> Topology:
    """Process group, megatron's model-parallel groups and its RNG tracker seeds.

    Ranks are laid out in megatron's default order tp-cp-ep-dp-pp: TP fastest, then CP, then DP,
    then PP slowest (global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))), so
    a pipeline stage's TP groups stay on one node and stages may span nodes. Data parallelism
    takes world / (tp * cp * pp) ranks; the CP ranks and pipeline stages of one DP rank read the
    same batches. `vpp` > 1 interleaves that many model chunks per stage.
    """
    init_process_group(device)
    world = dist.get_world_size()
    vpp = vpp if vpp and vpp > 1 else None
    if world % (tp * cp * pp):
        raise ValueError(f"parallel.tp x parallel.cp x parallel.pp ({tp} x {cp} x {pp}) must "
                         f"divide the number of processes ({world})")
    if vpp and pp == 1:
        raise ValueError(f"parallel.vpp={vpp} interleaves pipeline stages: it needs parallel.pp "
                         "> 1 (or set parallel.vpp=null)")
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
    return Topology(
        device=device, rank=dist.get_rank(), world_size=world, tp=tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(), cp=cp,
        cp_rank=parallel_state.get_context_parallel_rank(), pp=pp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(), vpp=vpp or 1,
    )


def shutdown() -> None:
    """Tear down megatron's groups and the process group (tests run several jobs per process)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: MegatronModule, *, distributed_optimizer: bool,
               disable_bucketing: bool = False) -> DistributedDataParallel:
    """bf16 cast (megatron's Float16Module) when configured, then megatron's DDP with fp32 grads."""
    if model.config.bf16:
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(model.config, ddp_config, model,
                                   disable_bucketing=disable_bucketing)


def wrap_chunks(chunks: list[MegatronModule], *,
                distributed_optimizer: bool) -> list[DistributedDataParallel]:
    """`wrap_model` for each pipeline chunk of this rank (megatron buckets only the first)."""
    return [wrap_model(chunk, distributed_optimizer=distributed_optimizer,
                       disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


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
