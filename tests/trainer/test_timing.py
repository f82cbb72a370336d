"""trainer/timing.py: seconds per phase, added up when a phase is entered again."""

from __future__ import annotations

import time

import pytest

from trainer.timing import Phases, process_age


def test_phases_add_up_and_keep_their_order() -> None:
    phases = Phases()
    with phases("load"):
        time.sleep(0.02)
    with phases("decode"):
        time.sleep(0.01)
    with phases("load"):
        time.sleep(0.02)
    phases.add_all({"engine.prefill": 0.5})
    seconds = phases.to_dict()
    assert list(seconds)[:3] == ["load", "decode", "engine.prefill"]
    assert seconds["load"] >= 0.04 and 0.01 <= seconds["decode"] < seconds["load"]
    assert seconds["engine.prefill"] == 0.5
    summary = phases.summary()
    assert summary.startswith("seconds: load ") and summary.endswith(", engine.prefill 0.5") \
        or ", engine.prefill 0.5, before " in summary


def test_a_phase_that_raises_is_still_timed() -> None:
    phases = Phases()
    with pytest.raises(KeyError), phases("data"):
        raise KeyError("x")
    assert "data" in phases.seconds


def test_the_process_age_counts_from_the_interpreters_start() -> None:
    age = process_age()
    assert age is not None and age > 0
    time.sleep(0.05)
    assert process_age() >= age + 0.04
