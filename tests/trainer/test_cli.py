"""`python -m trainer` as users run it: the default job, wandb offline, two ranks with TP=2 as
torchrun starts them (forked from the preloaded server: tests/conftest.py's `start_module`; the
new interpreters and torchrun itself: test_quiet_run.py, test_entry_errors.py, test_stop.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ckpt.paths import resolve_checkpoint
from tests.conftest import FAST, assert_tp2_checkpoint_resumes_at_tp1_and_tp2, read_metrics
from tests.module_runs import run_module, run_module_ranks

pytestmark = pytest.mark.slow


def _trains(args: list[str], cwd: Path, nproc: int = 1, **env: str | None) -> None:
    """`python -m trainer args` (on `nproc` ranks) ends with status 0."""
    ranks = ([run_module("trainer", args, cwd, env)] if nproc == 1 else
             run_module_ranks("trainer", args, nproc, cwd, env))
    for rank in ranks:
        assert rank.returncode == 0, f"{args} failed:\n{rank.stdout[-3000:]}\n{rank.stderr[-3000:]}"


def test_default_job_trains_under_two_minutes_with_wandb_offline(tmp_path: Path) -> None:
    start = time.monotonic()
    _trains(["hydra.run.dir=run"], tmp_path, WANDB_MODE=None)
    elapsed = time.monotonic() - start
    run_dir = tmp_path / "run"
    rows = read_metrics(run_dir)
    assert elapsed < 120, f"default job took {elapsed:.0f}s"
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert resolve_checkpoint(run_dir / "checkpoints").name == "iter_0000060"
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))

    # A resumed run continues the same wandb run (same id).
    _trains(["hydra.run.dir=resumed", "trainer.max_steps=62",
             f"checkpoint.load={run_dir / 'checkpoints'}"], tmp_path, WANDB_MODE=None)
    resumed = list((tmp_path / "resumed" / "wandb").glob("offline-run-*"))
    assert len(resumed) == 1
    assert resumed[0].name.split("-")[-1] == offline[0].name.split("-")[-1]


def test_tp2_matches_tp1_and_its_checkpoint_resumes_at_tp1_and_tp2(tmp_path: Path) -> None:
    common = FAST + ["trainer.max_steps=6", "trainer.save_interval=3"]
    _trains(common + ["hydra.run.dir=tp1"], tmp_path)
    _trains(common + ["hydra.run.dir=tp2", "parallel.tp=2"], tmp_path, nproc=2)
    tp1, tp2 = read_metrics(tmp_path / "tp1"), read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == list(range(1, 7))  # rank 1 logged nothing
    for a, b in zip(tp1, tp2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-4)
    # Only rank 0 wrote Hydra's outputs: one run directory, one job log.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp1", "tp2"]
    assert sorted(p.name for p in (tmp_path / "tp2").iterdir()) == [
        ".hydra", "checkpoints", "metrics.jsonl", "run.lock", "train.log"]

    # The TP=2 checkpoint at step 3 resumes at TP=1 and at TP=2 with the same next-step losses.
    assert_tp2_checkpoint_resumes_at_tp1_and_tp2(tmp_path, common)
