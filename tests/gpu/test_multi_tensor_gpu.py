"""parallel.multi_tensor on the GPU: no host sync (megatron's fallback norm syncs per tensor) and
megatron's fallback results, fp32 grads and the fp32 -> bf16 param copy."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils as megatron_utils

from parallel import multi_tensor

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _grads() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s, device="cuda") for s in [(2048, 2048), (6144, 2048), (2048,), (7, 3)]]


def test_norm_and_copy_run_without_a_host_sync() -> None:
    grads, flag = _grads(), torch.zeros(1, dtype=torch.int, device="cuda")
    params = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = multi_tensor.l2_norm(2048 * 32, flag, [grads], False)
        multi_tensor.scale(2048 * 32, flag, [grads, params], 1.0)
        multi_tensor.scale(2048 * 32, flag, [grads, grads], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    theirs, _ = megatron_utils.local_multi_tensor_l2_norm(2048 * 32, flag, [_grads()], False)
    torch.testing.assert_close(norm, theirs, rtol=1e-6, atol=0)
    for param, grad, original in zip(params, grads, _grads()):
        assert torch.equal(param, original.to(torch.bfloat16))
        assert torch.equal(grad, original * 0.5)
