"""Which path one Dual Chunk Attention call takes: decided here alone, logged once per path.

Every DCA call asks `route` (or `route_cp` under context parallelism) and runs what it returns;
the forward, its backward and the CUDA graphs read the same `Route` from the call's plan, so they
cannot disagree. The paths, in the order they are tried (docs/architecture.md has the table):

    context_parallel  parallel.cp > 1: a ring over the CP group        cp_variants.py
    plain_causal      every document fits in C and 2L, no logit scaling:
                      one causal call at in-document positions          causal.py
    cuda_graphs       dca_cuda_graphs on CUDA bf16/fp16, no packed documents: the kernels or
                      the part calls below, captured once per shape     graphs.py
    kernels           DCA's own FA4 kernels, where `kernel_refusal` finds nothing against
                      them                                              grouped.py
    part_calls        a dense call per part and chunk group, merged by LSE, through
                      the kernel lse_attention.py picks                 attention.py, backward.py
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import NamedTuple

import torch

from models.attention import kernels
from models.attention.dca.plan import (
    KERNEL_BLOCK,
    KERNEL_HEAD_DIMS,
    KernelPaths,
    check_backward,
)

log = logging.getLogger(__name__)


class DCAPath(StrEnum):
    CONTEXT_PARALLEL = "context_parallel"
    PLAIN_CAUSAL = "plain_causal"
    CUDA_GRAPHS = "cuda_graphs"
    KERNELS = "kernels"
    PART_CALLS = "part_calls"


class Route(NamedTuple):
    """Where one DCA call runs and why; `paths`: how its kernels or part calls run (under
    cuda_graphs, what the graphs replay)."""
    path: DCAPath
    reason: str
    paths: KernelPaths = KernelPaths()


_logged: set[tuple[DCAPath, str]] = set()


def _chosen(route: Route) -> Route:
    """`route`, logged the first time this process takes its path for its reason."""
    if (route.path, route.reason) not in _logged:
        _logged.add((route.path, route.reason))
        log.info("DCA runs through %s: %s", route.path.value, route.reason)
    return route


def kernel_refusal(q: torch.Tensor, length: int, packed: bool) -> str | None:
    """Why DCA's kernels (fa4_forward.py, fa4_backward.py) cannot serve DCA on q ([b, s, hq, d]
    or its heads in groups) with chunk length `length` (`packed`: documents given), or None when
    they can: kernel fa4 on a Hopper GPU (they derive from FA4's SM90 kernels; on later GPUs the
    part calls run FA4's kernels for them), bf16/fp16, one document per sequence, L and the
    sequence multiples of the kernels' tile (each tile then lies in one query chunk and one key
    chunk), head dims KERNEL_HEAD_DIMS."""
    if not kernels.fa4_applies(q):
        why = ("not CUDA bf16/fp16" if not q.is_cuda or q.dtype not in (torch.float16,
                                                                        torch.bfloat16)
               else f"attention kernel {kernels.active()}" if kernels.active() != "fa4"
               else "a head dim FA4 does not take")
        return f"{why} (DCA's kernels run through FA4)"
    if not kernels.hopper(q.device):
        return "not a Hopper GPU (DCA's kernels derive from FA4's SM90 kernels)"
    if packed:
        return "packed documents (DCA's kernels take one document per sequence)"
    if length % KERNEL_BLOCK or q.shape[1] % KERNEL_BLOCK:
        return f"chunk length C - w or the sequence not a multiple of {KERNEL_BLOCK}"
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        return f"head dim not one of {KERNEL_HEAD_DIMS}"
    return None


def plain_causal(longest: int, chunk_size: int, local_size: int, scaled: bool) -> bool:
    """Whether DCA over documents of at most `longest` tokens is causal attention under RoPE
    at their own positions: no logit scaling, and at most C tokens and 2L (no inter part).
    Chunk 1's offsets r < w then put its successive query at r + L = p, unclamped, so every
    relative distance is the true one."""
    return not scaled and longest <= min(chunk_size, 2 * (chunk_size - local_size))


def route(q: torch.Tensor, *, chunk_size: int, local_size: int, longest: int, packed: bool,
          scaled: bool, backward: str, keep_rotated: bool, cuda_graphs: bool) -> Route:
    """The path of one DCA call on q (`longest`: its longest document; `packed`: documents
    given; `scaled`: length-dependent logit scaling on) under the run's settings: `backward`
    (dca_backward: auto | one_piece | parts), `keep_rotated` (dca_keep_rotated, with the kernels
    only), `cuda_graphs` (dca_cuda_graphs)."""
    check_backward(backward)
    if plain_causal(longest, chunk_size, local_size, scaled):
        return _chosen(Route(DCAPath.PLAIN_CAUSAL,
                             "every document fits in the chunk: one causal call"))
    graphs = (cuda_graphs and not packed and q.is_cuda
              and q.dtype in (torch.bfloat16, torch.float16)
              and not torch.cuda.is_current_stream_capturing())
    refusal = ("dca_backward=parts" if backward == "parts"
               else kernel_refusal(q, chunk_size - local_size, packed))
    paths = KernelPaths() if refusal else KernelPaths(
        kernels=True, one_piece=backward == "one_piece", keep_rotated=keep_rotated and not graphs)
    inner = DCAPath.PART_CALLS if refusal else DCAPath.KERNELS
    if graphs:
        return _chosen(Route(DCAPath.CUDA_GRAPHS, f"dca_cuda_graphs, replaying the {inner.value}"
                             + (f" ({refusal})" if refusal else ""), paths))
    if refusal:
        return _chosen(Route(DCAPath.PART_CALLS, refusal, paths))
    return _chosen(Route(DCAPath.KERNELS, "FA4 on a Hopper GPU, tile-aligned"
                         + (", the backward in one piece" if paths.one_piece else ""), paths))


def route_cp() -> Route:
    """The path of a DCA call under context parallelism (the module's `attend_cp`)."""
    return _chosen(Route(DCAPath.CONTEXT_PARALLEL, "parallel.cp > 1: a ring over the CP group"))
