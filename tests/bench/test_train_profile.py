"""bench/train.py's profile summary on a hand-made profile: kernel categories, the top kernels of
each, GPU busy time (overlap counted once) and the idle gaps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from bench import train


class _Range:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


def _kernel(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=_Range(start, end), is_user_annotation=False)


class _Profile:
    def __init__(self, events: list[SimpleNamespace]) -> None:
        self._events = events

    def events(self) -> list[SimpleNamespace]:
        return self._events

    def key_averages(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(key="aten::mm", self_device_time_total=2000.0, count=2)]


def test_profile_summary_categories_gaps_and_busy_time() -> None:
    events = [
        _kernel("nvjet_sm90_gemm", 0.0, 1000.0),
        _kernel("nvjet_sm90_gemm", 500.0, 1500.0),  # overlaps the first: busy counts it once
        _kernel("void at::native::vectorized_elementwise_kernel<8>", 4500.0, 4600.0),  # 3 ms gap
        _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 4700.0, 9700.0),
        SimpleNamespace(name="Optimizer.step#AdamW.step", time_range=_Range(0.0, 9700.0),
                        device_type=torch.autograd.DeviceType.CUDA, is_user_annotation=True),
        SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU,
                        time_range=_Range(0.0, 10.0), is_user_annotation=False),
    ]
    summary = train.profile_summary(_Profile(events), wall_ms=12.0)
    assert summary["kernels"] == 4
    assert summary["annotations_left_out"] == ["Optimizer.step#AdamW.step"]
    assert abs(summary["gpu_busy_ms"] - 6.6) < 1e-9  # 1.5 + 0.1 + 5.0
    assert summary["categories"]["GEMM"] == 2.0
    assert summary["top_in_category"]["GEMM"] == [("nvjet_sm90_gemm", 2.0, 2)]
    assert list(summary["categories"])[0] == "attention kernels (cuDNN/flash)"  # 5 ms: first
    assert summary["timeline"].startswith("GPU: 4 kernels, busy 6.60 ms of 9.70 ms")
    assert "largest: 3000 us before void at::native::vectorized_elementwise" in summary["timeline"]


def test_summary_times_the_steps_after_warm_up_and_keeps_the_warm_up_steps_own() -> None:
    """The first steps hold the JIT compiles a run pays for: out of the medians, reported apart
    (`warmup_steps_s`); a profiled last step is left out too."""
    rows = [{"tokens_per_s": 1000 / t, "tflops_per_gpu": 1 / t, "mfu": 0.5 / t, "step_time_s": t,
             "memory_gb": 1.0, "loss": 6 - i, "attention_kernel": "fa4"}
            for i, t in enumerate((30.0, 1.5, 1.0, 1.2, 1.1, 9.0))]
    summary = train.summarize(rows, warmup=2, profiled=True)
    assert summary["warmup_steps_s"] == [30.0, 1.5]
    assert summary["step_s"] == 1.1 and summary["timed_steps"] == 3
    assert summary["loss_first"] == 6 and summary["kernel"] == "fa4"


def test_trace_paths_name_the_case() -> None:
    case = {"model": "gpt_1p3b", "attention": "dca", "seq": 32768, "variant": "-"}
    assert train.trace_path(None, case) is None
    assert str(train.trace_path(Path("out"), case)) == "out/gpt_1p3b_dca_32768.json.gz"
    assert train.trace_path(Path("out"), {**case, "variant": "fa4"}).name == (
        "gpt_1p3b_dca_32768_fa4.json.gz")


def test_under_torchrun_each_rank_writes_its_own_trace_and_summary(monkeypatch) -> None:
    monkeypatch.setattr(train, "WORLD", 2)
    monkeypatch.setattr(train, "RANK", 1)
    case = {"model": "gpt_1p3b", "attention": "dca", "seq": 16384, "variant": "-"}
    trace = train.trace_path(Path("out"), case)
    assert trace.name == "gpt_1p3b_dca_16384_rank1.json.gz"
    assert train.summary_path(trace).name == "gpt_1p3b_dca_16384_rank1.summary.json"
