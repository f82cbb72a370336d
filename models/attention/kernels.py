"""Which attention kernel runs on the GPU (`trainer.attention_kernel`), and the FlashAttention-4
calls.

Kernels (the setting's values):
  auto   FlashAttention-4 on SM90+ when it imports, else cudnn on CUDA (logged once per run)
  fa4    FlashAttention-4 (PyPI `flash-attn-4`, CuTe DSL; `pip install -e ".[fa4]"`)
  cudnn  torch's cuDNN SDPA kernels, its flash kernels where cuDNN refuses a shape
  flash  torch's flash SDPA kernels
  math   torch's math SDPA and the plain math LSE path (materialises the score matrix)
The choice applies to CUDA fp16/bf16 tensors; CPU and float32/float64 inputs always take the
math paths. FA4 is imported lazily, only on a CUDA device that asks for it: CPU runs and CI
need none of it. Its compiled kernels are cached on disk across runs
(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED, set here unless the environment sets it).

FA4's layout is [b, s, h, d] with any strides of unit last stride (16-byte aligned); its lse
is [b, h, s] float32, as lse_attention.py's. GQA is native (K/V are never repeated).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from models.attention import fa4_api
from models.options import AttentionKernel

log = logging.getLogger(__name__)

KERNELS = tuple(AttentionKernel)  # the setting's values, declared in models/options.py
FA4_INSTALL = 'pip install -e ".[fa4]"'

# setting: the requested kernel (trainer.attention_kernel); gpu: what it resolved to for CUDA
# tensors (None until a CUDA call or a GPU build resolves it); fa4 / fa4_error: the lazy import
_state: dict[str, object] = {"setting": "auto", "gpu": None, "fa4": None, "fa4_error": None}


class KernelUnavailable(ValueError):
    """An explicitly chosen kernel cannot run here (e.g. fa4 without FlashAttention-4)."""


def fa4_module() -> ModuleType | None:
    """FA4's `flash_attn.cute.interface`, imported once; None when it does not import."""
    if _state["fa4"] is None and _state["fa4_error"] is None:
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        try:
            from flash_attn.cute import interface  # ~10 s on first import
            _state["fa4"] = interface
            fa4_api.check_version()
        except Exception as exc:  # ImportError, or a broken CUDA/DSL install underneath
            _state["fa4_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return _state["fa4"]  # type: ignore[return-value]


def _sm90_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def resolve(name: str, cuda: bool | None = None) -> str:
    """The concrete kernel `name` means on this machine (`cuda`: whether the run uses the GPU;
    default: whether one is present). Raises KernelUnavailable for an explicit fa4 that cannot
    run, ValueError for an unknown name."""
    if name not in KERNELS:
        raise ValueError(f"trainer.attention_kernel={name!r} is unknown; choose one of "
                         f"{', '.join(KERNELS)}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if name == "auto":
        if not cuda:
            return "math"
        return "fa4" if _sm90_or_newer() and fa4_module() is not None else "cudnn"
    if name == "fa4" and cuda:
        if not _sm90_or_newer():
            raise KernelUnavailable("trainer.attention_kernel=fa4 needs an SM90+ GPU (Hopper or "
                                    "newer); use trainer.attention_kernel=auto or cudnn")
        if fa4_module() is None:
            raise KernelUnavailable(f"trainer.attention_kernel=fa4 needs FlashAttention-4: "
                                    f"{FA4_INSTALL} ({_state['fa4_error']})")
    return name


def use(name: str, cuda: bool | None = None) -> str:
    """Make `name` the kernel of every attention call from now on; returns what runs (on a run
    without the GPU, `cuda` False: math; a later CUDA call resolves the setting for the GPU).
    `auto` logs its choice the first time it resolves for the GPU in this process."""
    chosen = resolve(name, cuda)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda and name == "auto" and _state["gpu"] != chosen:
        log.info("trainer.attention_kernel=auto chose %s%s", chosen, "" if chosen == "fa4" else
                 f" (FlashAttention-4: {_state['fa4_error'] or 'needs an SM90+ GPU'})")
    _state["setting"], _state["gpu"] = name, chosen if cuda else None
    return chosen if cuda else "math"


def active() -> str:
    """The kernel of CUDA fp16/bf16 attention calls (the setting, resolved on first use)."""
    if _state["gpu"] is None:
        use(_state["setting"], cuda=True)  # type: ignore[arg-type]
    return _state["gpu"]  # type: ignore[return-value]


@contextlib.contextmanager
def using(name: str) -> Iterator[str]:
    """`name` as the kernel inside the block (benchmarks and tests compare kernels)."""
    before = _state["setting"], _state["gpu"]
    try:
        yield use(name, cuda=True)
    finally:
        _state["setting"], _state["gpu"] = before


def fa4_applies(x: torch.Tensor) -> bool:
    """Whether a call on `x` (head dim last) runs through FA4 under the active kernel."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and active() == "fa4"
            and fa4_takes_head_dim(x.shape[-1]))


def hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (SM90), the one architecture FA4's SM90 kernels run on
    (their WGMMA instructions exist on SM90 only): DCA's own kernels derive from them, so on
    later GPUs DCA takes the part calls, which FA4 dispatches to that GPU's kernels."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def fa4_takes_head_dim(head_dim: int) -> bool:
    """Whether FA4 serves this head dim; the others take the next kernel (cuDNN).

    FA4's SM90 backward (flash-attn-4 4.0.0b36) pads the head dim to 16 columns in its main
    kernel but to 32 in the float32 accumulators' post-processing (dQ; dK/dV under GQA), 64 on
    both sides above 128, so up to 128 the two agree only at multiples of 32. On the H100 FA4's
    own causal backward gave dq 1.1 off (relative) at head dims 72 and 80, and dk, dv too with
    GQA (docs/benchmarks.md, "Attention kernels"); the upstream fix, one rounding for both, is
    https://github.com/Dao-AILab/flash-attention/pull/2896 (open as of 2026-11).
    """
    return head_dim % 32 == 0 or head_dim > 128


def fa4_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention through FA4's autograd functions: q [b, s, hq, d], k, v [b, s, hk, d]
    -> [b, s, hq, d]. With `cu_seqlens` (batch 1; cumulative sequence lengths from 0) each
    sequence is its own causal problem, in one varlen call."""
    fa4 = fa4_module()
    if cu_seqlens is None:
        return fa4.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True)[0]
    longest = int(cu_seqlens.diff().max())  # a host sync unless cu_seqlens is on the CPU
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = fa4.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=longest, max_seqlen_k=longest,
                                     softmax_scale=softmax_scale, causal=True)[0]
    return out.unsqueeze(0)  # [t, hq, d] -> [1, t, hq, d]


def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """lse_attention's forward through FA4: q [b, hq, sq, d], k, v [b, hk, sk, d] views ->
    (out [b, hq, sq, d] view of a token-major tensor, lse [b, hq, sq] float32)."""
    out, lse = fa4_module()._flash_attn_fwd(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
        causal=causal, return_lse=True)[:2]
    return out.transpose(1, 2), lse


def fa4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lse_attention's backward through FA4 with any (merged) out and lse, same layouts as
    fa4_forward: (dq [b, hq, sq, d], dk, dv [b, hk, sk, d]) views."""
    dq, dk, dv = fa4_module()._flash_attn_bwd(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
        dout.transpose(1, 2), lse, softmax_scale=scale, causal=causal)[:3]
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
