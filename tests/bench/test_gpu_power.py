"""bench/gpu_power.py on nvidia-smi lines written by hand: idle and unreadable samples are left
out, clocks and power are medians over the busy ones, the power-cap bit is read from the reasons
mask."""

from __future__ import annotations

import pytest
import torch

from bench import gpu_power

LINES = [
    "345, 1980, 71.88, 700.00, 0, 0x0000000000000001",  # idle: left out
    "1620, 1980, 694.10, 700.00, 100, 0x0000000000000004",  # power-capped
    "1755, 1980, 690.00, 700.00, 98, 0x0000000000000004",
    "1980, 1980, 455.50, 700.00, 95, 0x0000000000000000",
    "1500, 1980, [N/A], 700.00, 100, 0x0000000000000004",  # unreadable: skipped
    "garbage",
]


def test_busy_samples_give_median_clock_power_and_the_capped_share() -> None:
    samples = gpu_power.parse(LINES)
    assert len(samples) == 4
    summary = gpu_power.summarize(samples)
    assert summary == {"sm_clock_mhz": 1755.0, "max_sm_clock_mhz": 1980.0, "power_w": 690.0,
                       "power_limit_w": 700.0, "power_capped": pytest.approx(2 / 3),
                       "busy_samples": 3}
    assert gpu_power.describe(summary) == "1,755 MHz, 690 W (capped 67%)"


def test_no_busy_sample_gives_no_summary() -> None:
    assert gpu_power.summarize(gpu_power.parse(LINES[:1])) is None
    assert gpu_power.describe(None) == "-"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour (tests/gpu samples a GPU)")
def test_sampling_without_a_gpu_records_nothing() -> None:
    sink: list[dict] = []
    with gpu_power.sampled(sink):
        pass
    assert sink == []
