"""A real `python -m trainer` run prints no "Transformer Engine and Apex are
not installed" lines, and trains at an odd seq_length without context parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt.paths import resolve_checkpoint
from tests.conftest import FAST, read_metrics, run_cli
from tests.module_runs import run_module_ranks

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


def test_a_tp2_save_and_resume_print_no_rank_mismatch_or_deprecation(tmp_path: Path) -> None:
    """Every rank saves rank 0's wandb id (megatron compares the common state across
    ranks); megatron's torch_dist loader's FutureWarnings and its CUDA_DEVICE_MAX_CONNECTIONS
    advice (no CUDA here) are not printed."""
    common = [a for a in FAST if a != "logger=none"] + [
        "hydra.run.dir=run", "parallel.tp=2", "data.max_documents=40", "trainer.save_interval=1",
        "trainer.warmup_steps=0"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # Two ranks as torchrun starts them, forked from the preloaded server (tests/conftest.py):
    # these are runtime messages, printed by the save and the load, not by the imports.
    first = run_module_ranks("trainer", common + ["trainer.max_steps=1"], 2, tmp_path, env)
    resumed = run_module_ranks("trainer", common + ["trainer.max_steps=2",
                                                    "checkpoint.load=run/checkpoints"],
                               2, tmp_path, env)
    for proc in first + resumed:
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-3000:]
        for noise in ("differs from rank 0", "FutureWarning", "CUDA_DEVICE_MAX_CONNECTIONS"):
            assert noise not in output, output[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
