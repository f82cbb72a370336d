"""Fused kernels for the layer's elementwise parts (Triton), each with a plain-torch fallback.

`FusedRMSNorm` is a drop-in for the `torch.nn.RMSNorm` that megatron's local layer spec builds
(same parameter name and state dict, same float32 arithmetic): one pass forward (read x, write y
and a float32 rstd per row) and one pass backward (read x, dy, write dx; the weight gradient is
summed per block of rows, then over blocks). Selected by `trainer.fused_norm` (models/spec.py).
Unlike megatron's torch norms it runs under sequence parallelism (`parallel.sequence_parallel`):
its weight carries megatron's `sequence_parallel` mark, so the weight gradients of the TP ranks'
sequence slices are summed at the end of the backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from models.attention.rope import triton

if triton is not None:
    import triton.language as tl


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with megatron's norm constructor signature."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm") -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"FusedRMSNorm is an RMSNorm; the model uses {config.normalization}")
        if config.layernorm_zero_centered_gamma:  # no setting of this project asks for it
            raise ValueError("FusedRMSNorm does not store a zero-centred gamma; use the torch norm")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        # Under sequence parallelism each TP rank normalises its own slice of the sequence, so
        # its weight gradient is a partial sum: megatron's `finalize_model_grads` sums the
        # gradients of parameters marked so over the TP group (as for its own fused norms).
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton is None or not x.is_cuda or x.shape[-1] > 16384:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class _RMSNorm(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows, n = x2.shape
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        _rms_forward[(rows,)](x2, weight, y, rstd, n, x2.stride(0), eps, BLOCK_N=block,
                              num_warps=min(16, max(4, block // 256)))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = dy.reshape(rows, n)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
        block = triton.next_power_of_2(n)
        rows_per_program = 64
        programs = triton.cdiv(rows, rows_per_program)
        dw_partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        _rms_backward[(programs,)](x2, dy2, weight, rstd, dx, dw_partial, rows, n, x2.stride(0),
                                   dy2.stride(0), ROWS=rows_per_program, BLOCK_N=block,
                                   num_warps=min(16, max(4, block // 256)))
        dw = dw_partial.sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dw, None


if triton is not None:

    @triton.jit
    def _rms_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride, eps, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_backward(x_ptr, dy_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, M, N, sx, sdy,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(ROWS):
            row = (pid * ROWS + i).to(tl.int64)
            valid = mask & (row < M)  # rows past the end load zeros and store nothing
            x = tl.load(x_ptr + row * sx + cols, mask=valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * sdy + cols, mask=valid, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
            xhat = x * rstd
            g = dy * w
            dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
            tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)
            dw += dy * xhat
        tl.store(dw_ptr + pid * N + cols, dw, mask=mask)
