"""The GPU's SM clock and power draw while a benchmark runs: nvidia-smi sampled every 250 ms.

MFU is quoted against the H100's 989 TFLOP/s, a figure for full clocks (1,980 MHz). A long
1.3B step runs at the 700 W cap with the SM clock lowered to 1,530-1,665 MHz (docs/benchmarks.md),
so the clock and power printed beside each MFU figure say how much of a difference between runs
or machines is the GPU's and not the code's.

    with sampled(sink):
        ...  # the benchmark, on the current CUDA device
    sink[0]  # {"sm_clock_mhz": 1552, "power_w": 693.1, "power_capped": 1.0, ...} or nothing
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,utilization.gpu,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap: the driver lowers clocks to hold the limit
BUSY_UTIL = 90  # percent: samples below (start-up, compilation, host gaps) are left out


class Sample(NamedTuple):
    """One line of QUERY's output."""

    sm_mhz: float
    max_sm_mhz: float
    power_w: float
    limit_w: float
    util: float
    reasons: int


def parse(lines: Iterable[str]) -> list[Sample]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines; lines it could not fill ("[N/A]")
    are skipped."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(Sample._fields):
            continue
        try:
            *numbers, reasons = fields
            samples.append(Sample(*(float(x) for x in numbers), int(reasons, 16)))
        except ValueError:
            continue
    return samples


def summarize(samples: list[Sample]) -> dict[str, Any] | None:
    """Medians over the busy samples: SM clock, power, and the share of them power-capped."""
    busy = [s for s in samples if s.util >= BUSY_UTIL]
    if not busy:
        return None
    return {
        "sm_clock_mhz": statistics.median(s.sm_mhz for s in busy),
        "max_sm_clock_mhz": max(s.max_sm_mhz for s in busy),
        "power_w": statistics.median(s.power_w for s in busy),
        "power_limit_w": max(s.limit_w for s in busy),
        "power_capped": sum(s.reasons & SW_POWER_CAP != 0 for s in busy) / len(busy),
        "busy_samples": len(busy),
    }


@contextlib.contextmanager
def sampled(sink: list[dict[str, Any]], interval_ms: int = 250) -> Iterator[None]:
    """Sample the current CUDA device while the block runs; append the summary to `sink`
    (nothing without a GPU, nvidia-smi or busy samples)."""
    import torch

    if shutil.which("nvidia-smi") is None or not torch.cuda.is_available():
        yield
        return
    # by UUID: nvidia-smi's indices ignore CUDA_VISIBLE_DEVICES
    gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "-i", gpu,
                                 "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
                                stdout=out, stderr=subprocess.DEVNULL)
        try:
            yield
        finally:
            proc.terminate()
            proc.wait()
            out.seek(0)
            summary = summarize(parse(out))
            if summary is not None:
                sink.append(summary)


def describe(summary: dict[str, Any] | None) -> str:
    """`1,552 MHz, 693 W (capped 100%)`, or `-` where nothing was sampled."""
    if not summary:
        return "-"
    return (f"{summary['sm_clock_mhz']:,.0f} MHz, {summary['power_w']:.0f} W "
            f"(capped {100 * summary['power_capped']:.0f}%)")
