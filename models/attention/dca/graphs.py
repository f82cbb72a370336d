"""Dual Chunk Attention's whole forward and whole backward replayed as CUDA graphs.

With small chunks the host issues DCA's kernels (about a hundred per forward+backward: the cuDNN
calls and the Triton rotations and merges) slower than the GPU runs them. Training shapes are
static, so each shape (with its settings) is captured once, after an eager warm-up that compiles
the Triton kernels and builds the cuDNN plans; every layer and step then copies its inputs into
the graphs' buffers, replays, and copies the outputs out: one launch instead of ~100, for ~13
copies of q's size in extra memory traffic and the graphs' own memory, kept while the process
runs. Worth it where launches dominate (short sequences, small chunks);
`dual_chunk_attention(..., cuda_graphs=True)` opts in. What it gains: docs/benchmarks.md, "DCA as
CUDA graphs"; what memory it keeps: bench/dca_graph_memory.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models.attention.dca.plan import DCAPlan

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

_CACHE: dict[tuple[Any, ...], DCAGraphs] = {}


class DCAGraphs:
    """The forward (q, k, v -> out, lse) and backward (q, k, v, out, lse, dout -> dq, dk, dv)
    of one shape and plan, captured from `forward` and `backward` (attention.py's eager passes)."""

    def __init__(self, plan: DCAPlan, scale: float, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, forward: Forward, backward: Backward) -> None:
        self.q, self.k, self.v = (torch.zeros_like(x, memory_format=torch.contiguous_format)
                                  for x in (q, k, v))
        self.dout = torch.zeros_like(self.q)
        # Warm-up on a side stream (as torch.cuda.graph asks): Triton compiles, cuDNN builds its
        # plans and the position/table caches fill, none of which may happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out, lse = forward(self.q, self.k, self.v, plan, scale)
            backward(plan, scale, self.q, self.k, self.v, out, lse, self.dout)
            del out, lse
        torch.cuda.current_stream().wait_stream(side)
        # Separate pools: the backward's intermediates may not reuse the forward's memory,
        # since forwards of other layers replay between a layer's forward and backward.
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, capture_error_mode="thread_local"):
            self.out, self.lse = forward(self.q, self.k, self.v, plan, scale)
        with torch.cuda.graph(self.backward_graph, capture_error_mode="thread_local"):
            self.dq, self.dk, self.dv = backward(plan, scale, self.q, self.k, self.v, self.out,
                                                 self.lse, self.dout)
        self.plan = plan  # the graphs read its tables and positions: keep them alive

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of these inputs: new tensors (the graph's own are overwritten by the next
        replay, e.g. the next layer's)."""
        for static, x in ((self.q, q), (self.k, k), (self.v, v)):
            static.copy_(x)
        self.forward_graph.replay()
        return self.out.clone(), self.lse.clone()

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv): new tensors, like `forward`'s outputs."""
        for static, x in ((self.q, q), (self.k, k), (self.v, v), (self.out, out),
                          (self.lse, lse), (self.dout, dout)):
            static.copy_(x)
        self.backward_graph.replay()
        return self.dq.clone(), self.dk.clone(), self.dv.clone()


def graphs_for(key: tuple[Any, ...], plan: DCAPlan, scale: float, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, forward: Forward,
               backward: Backward) -> DCAGraphs:
    """The graphs of `key` (every setting the plan and the kernels depend on), captured on first
    use."""
    if key not in _CACHE:
        _CACHE[key] = DCAGraphs(plan, scale, q, k, v, forward, backward)
    return _CACHE[key]


def release() -> None:
    """Drop every captured graph and its memory (tests; a process changing shapes for good)."""
    _CACHE.clear()
