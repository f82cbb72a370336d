"""Step lines say where the run stands (step/max, elapsed, ETA; no TFLOP/s on a CPU,
where it reads 0.0), and a closing line says what was done and how to resume."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ckpt.paths import resolve_checkpoint
from trainer.train import duration


def test_step_lines_and_the_closing_line(run_training, tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.train"):
        run_training(["trainer.max_steps=3", "trainer.save_interval=2"])
    lines = [r.message for r in caplog.records]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and steps[0].startswith("step 1/3 | loss ")
    assert all(re.search(r"\| \d+s elapsed, ETA \d+s$", line) for line in steps), steps
    assert not any("TFLOP/s" in line for line in steps)
    assert steps[-1].endswith("ETA 0s")
    root = tmp_path / "run" / "checkpoints"
    assert lines[-1] == (f"done: 3 steps in {lines[-1].split(' in ')[1].split(';')[0]}; last "
                         f"checkpoint {root / 'iter_0000003'}; resume with checkpoint.load={root}")
    assert resolve_checkpoint(root) == root / "iter_0000003"


def test_a_run_without_saves_says_so(run_training, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.train"):
        run_training(["trainer.max_steps=1", "trainer.warmup_steps=0", "checkpoint.save=false"])
    assert re.fullmatch(r"done: 1 steps in \d+s; no checkpoint saved \(checkpoint.save=false\)",
                        caplog.records[-1].message)


def test_durations_read_as_clock_time() -> None:
    assert [duration(s) for s in (0.4, 59.6, 185, 7620)] == ["0s", "1m00s", "3m05s", "2h07m"]
