"""bench/timing.py's step timing, with a fake CUDA event clock (the GPU part runs on the
device): per-call times over back-to-back samples, warm-up excluded; alternating pairs; the
experiment scripts' comparison and patch-and-restore forms."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest
import torch

from bench import timing


class _Clock:
    """Milliseconds that each call of `step` advances; events read them when recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def step(self) -> None:
        self.calls += 1
        self.now += 2.0 if self.calls == 1 else 3.0  # the first (warm-up) call is slower


def _fake_event(clock: _Clock) -> type:
    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.t = None

        def record(self) -> None:
            self.t = clock.now

        def synchronize(self) -> None:
            assert self.t is not None

        def elapsed_time(self, end: Event) -> float:
            return end.t - self.t

    return Event


def _recorded_call(clock: _Clock, order: list[str], name: str, ms: float,
                   drift: float = 0.0) -> Callable[[], None]:
    """A call that takes `ms` on the clock, times (1 + drift x the calls so far), and records
    its name in `order`."""
    def run() -> None:
        order.append(name)
        clock.now += ms * (1 + drift * len(order))
    return run


@pytest.mark.parametrize("back_to_back", [1, 4])
def test_times_are_per_call_and_exclude_warm_up(back_to_back: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", _fake_event(clock))
    times = timing.time_ms(clock.step, warmup=1, repeats=5, back_to_back=back_to_back)
    assert times == [3.0] * 5
    assert clock.calls == 1 + 5 * back_to_back


def _drifting_pair(monkeypatch: pytest.MonkeyPatch, drift: float,
                   ) -> tuple[list[str], Callable[[], None], Callable[[], None]]:
    """The fake clock installed, and a base step of 2 ms and another of 4 ms that slow down as
    the run goes on (the n-th call takes ms x (1 + drift n)), recording their calls in order."""
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", _fake_event(clock))
    order: list[str] = []
    base, other = (_recorded_call(clock, order, name, ms, drift)
                   for name, ms in (("base", 2.0), ("other", 4.0)))
    return order, base, other


def test_alternating_ratios_pair_each_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """--paired: base and other timed in turn, warm-ups first, one ratio per pair, the order
    swapped every pair; the clock slows down over the run (as a GPU reaching its power cap
    does) and each pair still gives the ratio of its own two calls."""
    order, base, other = _drifting_pair(monkeypatch, drift=0.1)
    ratios = timing.alternating_ratios(base, other, warmup=1, repeats=3)
    assert order == ["base", "other"] + ["base", "other", "other", "base", "base", "other"]
    assert [timing.base_first(i) for i in range(3)] == [True, False, True]
    expected = [2.0 * 1.3 / (4.0 * 1.4), 2.0 * 1.6 / (4.0 * 1.5), 2.0 * 1.7 / (4.0 * 1.8)]
    assert ratios == pytest.approx(expected)


def test_swapped_order_cancels_a_steady_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the clock slowing call by call, the step timed second in a pair is always the
    slower for it; the order swapped every pair puts that bias on each side in turn, so the
    pairs' ratios straddle the true one and their median is it (in one order it would be
    below 0.5 at every pair)."""
    _, base, other = _drifting_pair(monkeypatch, drift=0.01)
    ratios = timing.alternating_ratios(base, other, warmup=1, repeats=4)
    assert [r < 0.5 for r in ratios] == [True, False, True, False]
    assert statistics.median(ratios) == pytest.approx(0.5, abs=1e-4)


def test_alternating_samples_interleave_the_others_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several variants against one base: each repeat times a pair per variant in turn (base,
    a, base, b), so drift reaches every variant's pairs alike; describe_pairs states their
    medians and the ratio."""
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", _fake_event(clock))
    order: list[str] = []
    base, a, b = (_recorded_call(clock, order, name, ms)
                  for name, ms in (("base", 2.0), ("a", 4.0), ("b", 1.0)))
    samples = timing.alternating_samples(base, {"a": a, "b": b}, warmup=1, repeats=2)
    assert order == ["base", "a", "b"] + ["base", "a", "base", "b"] + ["a", "base", "b", "base"]
    assert samples == {"a": [(2.0, 4.0)] * 2, "b": [(2.0, 1.0)] * 2}
    assert timing.describe_pairs(samples["a"], "FA4 causal", "DCA") == (
        "FA4 causal 2.00 ms, DCA 4.00 ms, ratio 0.500 (0.500 - 0.500)")


def test_print_pairs_warms_up_then_states_each_pair_and_peak(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The experiment scripts' comparison: three warm-up calls each, then per calls-per-sample
    count the pairs of every other step against the base, with its peak over the base's."""
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", _fake_event(clock))
    order: list[str] = []
    base, a = (_recorded_call(clock, order, name, ms) for name, ms in (("base", 2.0), ("a", 4.0)))
    peaks = {base: 100.0, a: 111.0}
    timing.print_pairs(base, {"cut a": a}, repeats=2, back_to_back=[1, 3], label="32768 16/16",
                          peak=peaks.__getitem__)
    assert order == (["base"] * 3 + ["a"] * 3 + ["base", "a", "a", "base"]
                     + ["base"] * 3 + ["a"] * 6 + ["base"] * 3)
    assert capsys.readouterr().out.splitlines() == [
        f"32768 16/16 calls/sample {b2b} cut a: FA4 causal 2.00 ms, DCA 4.00 ms, ratio 0.500 "
        "(0.500 - 0.500), peak 111 MiB = 1.110x FA4 causal's 100" for b2b in (1, 3)]


def test_patched_sets_the_attribute_and_kernel_for_each_call_only() -> None:
    """An experiment script's form: the attribute and the kernel hold inside the step, and
    both are back after it, also when the step raises."""
    from types import SimpleNamespace

    from models.attention import kernels

    target = SimpleNamespace(rule="tree")
    before = kernels.active()
    seen = []
    step = timing.patched(lambda: seen.append((target.rule, kernels.active())), target, "rule",
                             "other", kernel="math")
    step()
    assert seen == [("other", "math")] and target.rule == "tree"
    assert kernels.active() == before

    def failing() -> None:
        raise RuntimeError("step failed")
    with pytest.raises(RuntimeError, match="step failed"):
        timing.patched(failing, target, "rule", "other", kernel="math")()
    assert target.rule == "tree"
