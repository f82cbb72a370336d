"""Timing any GPU step (a callable): per-call times between CUDA events, host time, peak
memory, and alternating pairs of steps (each pair meets the same clocks and power state, which
drift between runs by more than the differences being measured), with the experiment scripts'
helpers around them. bench/attention.py and bench/dca_cuts.py use them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from models.attention import kernels


def time_ms(step: Callable[[], object], warmup: int, repeats: int,
            back_to_back: int = 1) -> list[float]:
    """Milliseconds per call of `step`: `repeats` samples between CUDA events, each over
    `back_to_back` consecutive calls. With 1 the sample ends in a synchronisation, so the
    host's time to issue the call shows wherever it exceeds the kernels'; with more the host
    queues calls ahead of the GPU, as it does layer after layer inside a model, and a sample
    is their mean."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return times


def host_time_ms(step: Callable[[], object], repeats: int = 3) -> float:
    """Median milliseconds the host takes to issue `step` (no synchronisation inside the
    sample): below the GPU time when the host can run ahead, equal to it when `step` waits for
    the GPU somewhere."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_mib(step: Callable[[], object]) -> float:
    """The most memory one call of `step` allocates above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def alternating_samples(base: Callable[[], object], others: dict[str, Callable[[], object]],
                        warmup: int, repeats: int, back_to_back: int = 1,
                        ) -> dict[str, list[tuple[float, float]]]:
    """(base's ms, the other's ms) per sample for each of `others`: every sample a pair timed
    in turn, the others' pairs interleaved in each repeat, so each pair meets the same clocks
    and power state, which drift between separate runs by more than the ratios a goal asks
    about. The pair's order swaps every repeat (base first in even ones, `base_first`), so
    neither step always runs on the clock the other leaves. Everything is warmed up first."""
    for fn in (base, *others.values()):
        time_ms(fn, warmup, 0)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in others}
    for repeat in range(repeats):
        for name, fn in others.items():
            if base_first(repeat):
                t_base = time_ms(base, 0, 1, back_to_back)[0]
                t_other = time_ms(fn, 0, 1, back_to_back)[0]
            else:
                t_other = time_ms(fn, 0, 1, back_to_back)[0]
                t_base = time_ms(base, 0, 1, back_to_back)[0]
            samples[name].append((t_base, t_other))
    return samples


def base_first(sample: int) -> bool:
    """Whether alternating_samples timed the base first in this sample (its index)."""
    return sample % 2 == 0


def alternating_ratios(base: Callable[[], object], other: Callable[[], object], warmup: int,
                       repeats: int, back_to_back: int = 1) -> list[float]:
    """`base`'s time over `other`'s, sample by sample (alternating_samples)."""
    pairs = alternating_samples(base, {"other": other}, warmup, repeats, back_to_back)["other"]
    return [t_base / t_other for t_base, t_other in pairs]


def describe_pairs(samples: list[tuple[float, float]], base: str, other: str) -> str:
    """The medians of alternating_samples' pairs and the ratio, median (min - max)."""
    ratios = [t_base / t_other for t_base, t_other in samples]
    return (f"{base} {statistics.median(t for t, _ in samples):.2f} ms, {other} "
            f"{statistics.median(t for _, t in samples):.2f} ms, ratio "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f})")


def patched(step: Callable[[], object], target: object, name: str, value: object,
            kernel: str = "fa4") -> Callable[[], object]:
    """`step` run under `kernel` with `target.name` set to `value`, restored after each call
    (the experiment scripts' forms of one variant: a cut, a constant, a plan)."""
    def run() -> object:
        saved = getattr(target, name)
        setattr(target, name, value)
        try:
            with kernels.using(kernel):
                return step()
        finally:
            setattr(target, name, saved)
    return run


def print_pairs(base: Callable[[], object], others: dict[str, Callable[[], object]],
                repeats: int, back_to_back: list[int], label: str,
                peak: Callable[[Callable[[], object]], float] = peak_mib) -> None:
    """The experiment scripts' comparison: every step warmed up, each one's peak memory, then
    for each calls-per-sample count one line per other step, its alternating pairs against
    `base` (FA4 causal against DCA, describe_pairs) and its peak over base's; `label` starts
    each line (the shape and what the others vary)."""
    for fn in (base, *others.values()):
        time_ms(fn, 3, 0)
    peaks = {name: peak(fn) for name, fn in (("base", base), *others.items())}
    for b2b in back_to_back:
        pairs = alternating_samples(base, others, 0, repeats, b2b)
        for name, samples in pairs.items():
            print(f"{label} calls/sample {b2b} {name}: "
                  f"{describe_pairs(samples, 'FA4 causal', 'DCA')}, peak {peaks[name]:.0f} MiB"
                  f" = {peaks[name] / peaks['base']:.3f}x FA4 causal's {peaks['base']:.0f}",
                  flush=True)
