"""Fixtures the checkpoint tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAST, compose_config


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints root of a 4-step TP=1 run saved at steps 2 and 4 (read-only: tests that
    damage or change a checkpoint work on a copy)."""
    from trainer.train import train

    run_dir = tmp_path_factory.mktemp("tp1")
    train(compose_config(FAST + ["trainer.max_steps=4", "trainer.save_interval=2",
                                 f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)
    return run_dir / "checkpoints"
