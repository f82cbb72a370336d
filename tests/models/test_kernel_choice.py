"""The attention-kernel setting (models/attention/kernels.py) on a machine without
FlashAttention-4: what auto resolves to, the one-line error of an explicit fa4, and that CPU
attention never imports FA4."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import pytest
import torch

from models.attention import kernels
from models.attention.causal import causal_attention
from models.attention.lse_attention import _backend
from tests.conftest import FAST
from tests.module_runs import run_module
from trainer.errors import UserError
from trainer.validate import check_kernel


def _fresh(monkeypatch: pytest.MonkeyPatch, setting: str = "auto", gpu: str | None = None) -> None:
    """The kernel module's state as a new process with this setting (and GPU choice) has it."""
    monkeypatch.setattr(kernels, "_state", {"setting": setting, "gpu": gpu, "fa4": None,
                                            "fa4_error": None})


@pytest.fixture
def no_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA4 fails to import, and the module's cached import state is fresh."""
    real_import = builtins.__import__

    def fake_import(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("flash_attn"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    _fresh(monkeypatch)


def test_auto_without_a_gpu_is_math_and_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch)
    assert kernels.resolve("auto", cuda=False) == "math"
    assert kernels._state["fa4_error"] is None and kernels._state["fa4"] is None  # not tried
    q, k, v = (torch.randn(1, 16, h, 8) for h in (4, 2, 2))
    causal_attention(q, k, v)
    assert "flash_attn.cute" not in sys.modules or kernels._state["fa4"] is None


@pytest.mark.usefixtures("no_fa4")
def test_auto_on_a_gpu_without_fa4_is_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_sm90_or_newer", lambda: True)
    assert kernels.resolve("auto", cuda=True) == "cudnn"
    assert "ImportError" in kernels._state["fa4_error"]


@pytest.mark.usefixtures("no_fa4")
def test_auto_logs_its_choice_once(monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernels, "_sm90_or_newer", lambda: True)
    with caplog.at_level("INFO", logger=kernels.__name__):
        kernels.use("auto", cuda=True)
        kernels.use("auto", cuda=True)  # a second model in the same process: no new line
    lines = [r.getMessage() for r in caplog.records
             if "trainer.attention_kernel=auto" in r.getMessage()]
    assert len(lines) == 1 and "chose cudnn" in lines[0]


@pytest.mark.usefixtures("no_fa4")
def test_explicit_fa4_without_fa4_is_one_line_naming_the_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_sm90_or_newer", lambda: True)
    with pytest.raises(UserError) as err:
        check_kernel("fa4", cuda=True)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("trainer.attention_kernel=fa4 needs FlashAttention-4")
    assert 'pip install -e ".[fa4]"' in message


def test_explicit_fa4_on_a_pre_hopper_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_sm90_or_newer", lambda: False)
    with pytest.raises(UserError, match="SM90"):
        check_kernel("fa4", cuda=True)


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(UserError, match="trainer.attention_kernel='fast' is unknown"):
        check_kernel("fast", cuda=False)


@pytest.mark.parametrize(("name", "cuda", "expected"), [
    ("cudnn", True, "cudnn"), ("flash", True, "flash"), ("math", True, "math"),
    ("cudnn", False, "cudnn"), ("fa4", False, "fa4"),  # CPU tensors ignore the setting
])
def test_explicit_kernels_resolve_to_themselves(name: str, cuda: bool, expected: str) -> None:
    assert kernels.resolve(name, cuda) == expected


@pytest.mark.parametrize(("kernel", "order"), [
    ("fa4", ["fa4", "cudnn", "flash", "math"]), ("cudnn", ["cudnn", "flash", "math"]),
    ("flash", ["flash", "math"]), ("math", ["math"]),
])
def test_lse_backends_follow_the_setting(monkeypatch: pytest.MonkeyPatch, kernel: str,
                                         order: list[str]) -> None:
    """The LSE part calls (DCA, CP, kept causal) run the chosen kernel where it takes the
    shape, else the next in order; CPU and fp32 tensors take the math path whatever the
    setting."""
    _fresh(monkeypatch, kernel, kernel)
    cuda_bf16 = torch.empty(1, 2, 4, 64, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert _backend(cuda_bf16, cuda_bf16, cuda_bf16) == order[0]
    assert _backend(*[cuda_bf16.float()] * 3) == "math"
    head_dim_80 = torch.empty(1, 2, 4, 80, dtype=torch.bfloat16, device="meta")
    assert _backend(*[head_dim_80] * 3) == [x for x in order if x != "fa4"][0]


def test_a_head_dim_fa4_leaves_to_cudnn_is_logged(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernels, "resolve", lambda name, cuda: "fa4")
    with caplog.at_level("WARNING"):
        check_kernel("auto", cuda=True, head_dim=64)
        assert not caplog.records
        check_kernel("auto", cuda=True, head_dim=80)
    assert "head_dim 80 runs on cuDNN" in caplog.text


@pytest.mark.parametrize(("head_dim", "expected"), [
    (32, True), (64, True), (96, True), (128, True), (192, True), (256, True),
    (8, False), (72, False), (80, False), (112, False),
])
def test_fa4_only_at_head_dims_its_backward_pads_alike(monkeypatch: pytest.MonkeyPatch,
                                                       head_dim: int, expected: bool) -> None:
    """FA4's SM90 backward pads the head dim to 16 in its main kernel and to 32 in its
    accumulators' post-processing (64 for both above 128): other head dims take cuDNN, in the
    causal, chunked and DCA paths (fa4_applies) as in the LSE part calls (_backend)."""
    assert kernels.fa4_takes_head_dim(head_dim) is expected
    _fresh(monkeypatch, "fa4", "fa4")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.empty(1, 4, 2, head_dim, dtype=torch.bfloat16, device="meta")
    assert kernels.fa4_applies(q) is expected


@pytest.mark.parametrize(("capability", "expected"), [
    ((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False),
])
def test_only_hopper_runs_fa4s_sm90_kernels(monkeypatch: pytest.MonkeyPatch,
                                            capability: tuple[int, int], expected: bool) -> None:
    """DCA's own kernels derive from FA4's SM90 kernels (WGMMA: Hopper only), so they run on
    SM90 alone; Blackwell (10.x, 12.x) and the CPU take DCA's part calls, which FA4 runs with
    its kernels for that GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert kernels.hopper(torch.device("cuda", 0)) is expected
    assert kernels.hopper(torch.device("cpu")) is False


def test_a_cpu_build_leaves_the_gpu_choice_to_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model built for the CPU (math) in a process that later runs CUDA attention (the test
    suite on the GPU machine) must not pin CUDA calls to the math path: they resolve the
    setting for the GPU on first use."""
    _fresh(monkeypatch)
    monkeypatch.setattr(kernels, "_sm90_or_newer", lambda: False)
    assert kernels.use("auto", cuda=False) == "math"
    assert kernels.active() == "cudnn"  # what auto means for a pre-SM90 or FA4-less GPU
    assert kernels.use("flash", cuda=False) == "math"  # what the CPU run computes with
    assert kernels.active() == "flash"


def test_using_restores_the_previous_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch, "cudnn", "cudnn")
    with kernels.using("math"):
        assert kernels.active() == "math"
    assert kernels.active() == "cudnn"


@pytest.mark.slow
def test_the_trainer_refuses_a_bad_kernel_in_one_line(tmp_path: Path) -> None:
    """The setting (a run setting, `trainer.attention_kernel`) is checked when the config is
    composed, before data or model exist: one `error:` line naming it and its choices, exit 2
    (an explicit fa4 without FA4 on a GPU is one line too, from the run's other checks)."""
    proc = run_module("trainer", [*FAST, "hydra.run.dir=run", "trainer.attention_kernel=fast"],
                      tmp_path, {"HYDRA_FULL_ERROR": None, "LONGCTX_DEBUG": None})
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and ("trainer.attention_kernel='fast' must be one of auto, fa4, "
                                 "cudnn, flash, math") in errors[0]
