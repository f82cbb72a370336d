"""Issue 14 item 9: a real `python -m trainer` run prints no "Transformer Engine and Apex are
not installed" lines, and trains at an odd seq_length without context parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt.paths import resolve_checkpoint
from tests.conftest import FAST, read_metrics, run_cli

pytestmark = pytest.mark.slow


def test_run_is_quiet_and_trains_at_an_odd_length(tmp_path: Path) -> None:
    proc = run_cli(FAST + ["hydra.run.dir=run", "trainer.seq_length=63", "trainer.max_steps=2",
                           "trainer.save_interval=2", "data.max_documents=40"], cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert "Transformer Engine" not in output and "Apex" not in output, output[-3000:]
    assert "full scope is deprecated" not in output
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    # The checkpoint writer's helpers ran too (a save): quiet as well.
    assert resolve_checkpoint(tmp_path / "run" / "checkpoints").name == "iter_0000002"
