"""The GPU's SM clock and power draw while a benchmark runs: nvidia-smi sampled every 250 ms.

MFU is quoted against the H100's 989 TFLOP/s, a figure for full clocks (1,980 MHz). A long
1.3B step runs at the 700 W cap with the SM clock lowered to ~1,620 MHz (docs/benchmarks.md,
"The step's host overheads, and the power cap"), so the clock and power printed beside each MFU
figure say how much of a difference between runs or machines is the GPU's and not the code's.

    with sampled(torch.cuda.current_device(), sink):
        ...  # the benchmark
    sink[0]  # {"sm_clock_mhz": 1620, "power_w": 694.2, "power_capped": 0.96, ...} or nothing
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,utilization.gpu,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap: the driver lowers clocks to hold the limit
BUSY_UTIL = 90  # percent: samples below (start-up, compilation, host gaps) are left out


def parse(lines: Iterable[str]) -> list[tuple[float, ...]]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines as (SM MHz, max SM MHz, W, limit W,
    utilisation %, clock event reasons); lines it could not fill ("[N/A]") are skipped."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        try:
            *numbers, reasons = fields
            samples.append((*(float(x) for x in numbers), float(int(reasons, 16))))
        except ValueError:
            continue
    return samples


def summarize(samples: list[tuple[float, ...]]) -> dict[str, Any] | None:
    """Medians over the busy samples: SM clock, power, and the share of them power-capped."""
    busy = [s for s in samples if s[4] >= BUSY_UTIL]
    if not busy:
        return None
    return {
        "sm_clock_mhz": statistics.median(s[0] for s in busy),
        "max_sm_clock_mhz": max(s[1] for s in busy),
        "power_w": statistics.median(s[2] for s in busy),
        "power_limit_w": max(s[3] for s in busy),
        "power_capped": sum(int(s[5]) & SW_POWER_CAP != 0 for s in busy) / len(busy),
        "busy_samples": len(busy),
    }


@contextlib.contextmanager
def sampled(device: int, sink: list[dict[str, Any]], interval_ms: int = 250) -> Iterator[None]:
    """Sample CUDA device `device` while the block runs; append the summary to `sink` (nothing
    without nvidia-smi or busy samples)."""
    import torch

    if shutil.which("nvidia-smi") is None or not torch.cuda.is_available():
        yield
        return
    gpu = f"GPU-{torch.cuda.get_device_properties(device).uuid}"  # CUDA_VISIBLE_DEVICES-proof
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
    """`1,620 MHz, 694 W (capped 96%)`, or `-` where nothing was sampled."""
    if not summary:
        return "-"
    return (f"{summary['sm_clock_mhz']:,.0f} MHz, {summary['power_w']:.0f} W "
            f"(capped {100 * summary['power_capped']:.0f}%)")
