"""bench/gpu_power.py on a real GPU: nvidia-smi accepts the query and the device's UUID, and a
second of matmuls gives busy samples with a clock and a power draw."""

from __future__ import annotations

import time

import pytest
import torch

from bench import gpu_power

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_busy_gpu_is_sampled() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sink: list[dict] = []
    with gpu_power.sampled(sink, interval_ms=100):
        start = time.perf_counter()
        while time.perf_counter() - start < 1.5:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    (summary,) = sink
    assert summary["busy_samples"] >= 3
    assert 300 <= summary["sm_clock_mhz"] <= summary["max_sm_clock_mhz"]
    assert 0 < summary["power_w"] <= 1.1 * summary["power_limit_w"]
