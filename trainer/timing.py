"""Where a command's wall time goes: seconds per named phase, GPU work included.

`Phases` times `with phases("load"): ...` blocks; a phase's end waits for the GPU (work queued
inside a phase is that phase's), and a phase entered again adds up. `to_dict()` adds "before":
the process's age when timing began (`process_age`: interpreter, imports, Hydra).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch


def process_age() -> float | None:
    """Seconds since this process started (Linux `/proc`; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime (ticks)
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


class Phases:
    """Seconds per phase, in the order phases first ran."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.cuda = device is not None and device.type == "cuda"
        self.started_at = process_age()  # the process's age when timing began

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add_all(self, seconds: dict[str, float]) -> None:
        """Seconds measured elsewhere (the decoding engine's split of its phases' time)."""
        for name, value in seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + value

    def to_dict(self) -> dict[str, float]:
        out = {k: round(v, 3) for k, v in self.seconds.items()}
        if self.started_at is not None:
            out["before"] = round(self.started_at, 3)  # interpreter, imports, Hydra
        return out

    def summary(self) -> str:
        parts = [f"{k} {v:.1f}" for k, v in self.to_dict().items()]
        return "seconds: " + ", ".join(parts)
