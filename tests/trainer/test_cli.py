"""`python -m trainer` as users run it: the default job, wandb offline, torchrun with TP=2."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ckpt.paths import resolve_checkpoint
from tests.conftest import FAST, assert_tp2_checkpoint_resumes_at_tp1_and_tp2, read_metrics, run_cli

pytestmark = pytest.mark.slow


def test_default_job_trains_under_two_minutes_with_wandb_offline(tmp_path: Path) -> None:
    start = time.monotonic()
    run_cli(["hydra.run.dir=run"], cwd=tmp_path, env={"WANDB_MODE": None})
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
    run_cli(["hydra.run.dir=resumed", "trainer.max_steps=62",
             f"checkpoint.load={run_dir / 'checkpoints'}"], cwd=tmp_path, env={"WANDB_MODE": None})
    resumed = list((tmp_path / "resumed" / "wandb").glob("offline-run-*"))
    assert len(resumed) == 1
    assert resumed[0].name.split("-")[-1] == offline[0].name.split("-")[-1]


def test_tp2_matches_tp1_and_its_checkpoint_resumes_at_tp1_and_tp2(tmp_path: Path) -> None:
    common = FAST + ["trainer.max_steps=6", "trainer.save_interval=3"]
    run_cli(common + ["hydra.run.dir=tp1"], cwd=tmp_path)
    run_cli(common + ["hydra.run.dir=tp2", "parallel.tp=2"], cwd=tmp_path, nproc=2)
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
