"""megatron's multi-tensor fallbacks (used without apex or Transformer Engine) without host syncs.

megatron-core's optimizer reaches every parameter through two apex-style "multi-tensor" ops:
an l2 norm (the grad norm for clipping) and a scale (grad clipping, and the copy of the fp32
main params into the bf16 model params, a scale by 1). Without apex/TE it falls back to
`megatron.core.utils.local_multi_tensor_*`, whose norm reads every tensor's norm to the host
(one device sync per parameter tensor, each leaving the GPU idle until the host launches the
next kernel) and whose scale runs two kernels per
tensor (a scaled temporary, then a copy). These drop-ins keep the ops on the device in torch's
foreach kernels: a handful of launches for all tensors, no sync, same results
(tests/parallel/test_multi_tensor.py compares them with megatron's own fallbacks and with float64
references).
"""

from __future__ import annotations

import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads, optimizer

_FALLBACKS = {  # (module, name) -> megatron's fallback that we replace, and only that
    (clip_grads, "l2_norm_impl"): megatron_utils.local_multi_tensor_l2_norm,
    (clip_grads, "multi_tensor_scale_impl"): megatron_utils.local_multi_tensor_scale,
    (optimizer, "multi_tensor_scale_impl"): megatron_utils.local_multi_tensor_scale,
}


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
            per_tensor: bool, *args: object) -> tuple[torch.Tensor, None]:
    """The l2 norm over every tensor of `tensor_lists[0]`, as a float32 tensor of shape [1] on
    their device (apex's `multi_tensor_l2norm` contract; per-tensor norms are not supported)."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms: megatron's optimizer never asks for them")
    tensors = tensor_lists[0]
    # Each tensor's norm in float32 whatever its dtype (megatron's fallback reads them as Python
    # floats), then the norm of those norms.
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
          factor: float) -> None:
    """dst = src * factor for each pair of `tensor_lists` = [srcs, dsts] (apex's
    `multi_tensor_scale`); dst may be src (in-place clipping) or of another dtype (main -> model
    params). Like megatron's fallback it does not set `noop_flag` on inf/nan."""
    srcs, dsts = tensor_lists
    if all(s is d for s, d in zip(srcs, dsts)):
        torch._foreach_mul_(dsts, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dsts, srcs)
    else:  # one kernel per pair, no temporary (rare: megatron scales in place or copies)
        for src, dst in zip(srcs, dsts):
            torch.mul(src, factor, out=dst)


def restore() -> None:
    """Put megatron's fallbacks back where `install` replaced them (A/B benchmarks)."""
    for (module, name), fallback in _FALLBACKS.items():
        if getattr(module, name) in (l2_norm, scale):
            setattr(module, name, fallback)


def install() -> int:
    """Replace megatron's local multi-tensor fallbacks (where megatron chose them, i.e. apex and
    TE are absent) with these; returns how many were replaced. Idempotent."""
    ours = {"l2_norm_impl": l2_norm, "multi_tensor_scale_impl": scale}
    replaced = 0
    for (module, name), fallback in _FALLBACKS.items():
        if getattr(module, name) is fallback:
            setattr(module, name, ours[name])
            replaced += 1
    return replaced
