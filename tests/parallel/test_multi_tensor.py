"""parallel.multi_tensor against megatron's own apex-less fallbacks (the oracle it replaces) and
float64 references: the grad norm and the scale/copy of megatron's optimizer."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads, optimizer

from parallel import multi_tensor
from parallel.cpu_mode import enable_cpu_mode, end_cpu_work


@pytest.fixture(autouse=True, scope="module")
def _cpu_mode():
    """megatron's fallback norm puts its result on "cuda": the CPU here (also on a GPU host)."""
    if enable_cpu_mode():
        yield
        end_cpu_work()
    else:
        yield


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(7, 3), (128,), (2, 5, 11), (1,), (64, 64)]
    return [torch.randn(s, dtype=torch.float32).mul_(i + 1).to(dtype) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_matches_float64_and_megatrons_fallback(dtype: torch.dtype) -> None:
    tensors = _tensors(dtype)
    flag = torch.zeros(1, dtype=torch.int)
    ours, per_tensor = multi_tensor.l2_norm(2048 * 32, flag, [tensors], False)
    reference = torch.cat([t.double().flatten() for t in tensors]).norm()
    theirs, _ = megatron_utils.local_multi_tensor_l2_norm(2048 * 32, flag, [tensors], False)
    assert ours.shape == (1,) and ours.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(ours.double(), reference.reshape(1), rtol=1e-6, atol=0)
    if dtype == torch.float32:  # the trainer's case (fp32 grads): megatron's own figure
        torch.testing.assert_close(ours, theirs.to(ours.device), rtol=1e-6, atol=0)
    else:  # megatron's fallback takes bf16 tensors' norms in bf16 (0.2% off here); ours float32
        assert abs(ours.double() - reference) < abs(theirs.double() - reference)


def test_l2_norm_refuses_per_tensor_norms() -> None:
    with pytest.raises(NotImplementedError, match="per-tensor"):
        multi_tensor.l2_norm(1, torch.zeros(1), [_tensors(torch.float32)], True)


def test_scale_in_place_as_megatrons_fallback() -> None:
    ours, theirs = _tensors(torch.float32), _tensors(torch.float32)
    multi_tensor.scale(1, torch.zeros(1), [ours, ours], 0.37)
    megatron_utils.local_multi_tensor_scale(1, torch.zeros(1), [theirs, theirs], 0.37)
    for a, b, src in zip(ours, theirs, _tensors(torch.float32)):
        assert torch.equal(a, b) and not torch.equal(a, src)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_scale_into_other_dtype_as_megatrons_fallback(factor: float) -> None:
    """The main (fp32) -> model (bf16) param copy is a scale by 1 into other tensors."""
    src = _tensors(torch.float32)
    ours = [torch.zeros_like(t, dtype=torch.bfloat16) for t in src]
    theirs = [torch.zeros_like(t, dtype=torch.bfloat16) for t in src]
    multi_tensor.scale(1, torch.zeros(1), [src, ours], factor)
    megatron_utils.local_multi_tensor_scale(1, torch.zeros(1), [src, theirs], factor)
    for a, b, s in zip(ours, theirs, src):
        assert torch.equal(a, b)
        assert torch.equal(a, (s.double() * factor).to(torch.bfloat16))  # one rounding


def test_install_replaces_only_megatrons_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [(clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
             (optimizer, "multi_tensor_scale_impl")]
    for module, name in names:  # as megatron leaves them without apex / TE
        monkeypatch.setattr(module, name, getattr(megatron_utils, {
            "l2_norm_impl": "local_multi_tensor_l2_norm"}.get(name, "local_multi_tensor_scale")))
    apex_like = object()  # an apex / TE kernel megatron found: left alone
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", apex_like)
    assert multi_tensor.install() == 2
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.scale
    assert optimizer.multi_tensor_scale_impl is apex_like
    assert multi_tensor.install() == 0  # idempotent
    multi_tensor.restore()  # megatron's fallbacks back, the apex-like one untouched
    assert clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale
    assert optimizer.multi_tensor_scale_impl is apex_like
