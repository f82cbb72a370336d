"""Shared fixtures: Hydra compose, small in-process training runs, a torchrun launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from trainer.config import register_configs

register_configs()

REPO = Path(__file__).resolve().parents[1]

# A few seconds per run on 2 cores: tiny model, short sequences, the first 60 documents.
FAST = [
    "logger=none",
    "trainer.seq_length=64",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=4",
    "trainer.warmup_steps=1",
    "trainer.eval_interval=0",
    "data.max_documents=60",
]


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The run's config exactly as `python -m trainer <overrides>` composes it."""
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def run_training(tmp_path: Path) -> Callable[..., list[dict[str, Any]]]:
    """Train in this process; returns the metrics.jsonl rows."""
    from trainer.train import train

    def run(overrides: list[str], name: str = "run") -> list[dict[str, Any]]:
        run_dir = tmp_path / name
        run_dir.mkdir(exist_ok=True)
        cfg = compose_config(FAST + [f"checkpoint.dir={run_dir / 'checkpoints'}"] + overrides)
        train(cfg, run_dir)
        return read_metrics(run_dir)

    return run


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_cli(args: list[str], *, nproc: int = 1, cwd: Path, timeout: int = 600,
            env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer ...`, or the same under `torch.distributed.run` with `nproc` ranks.
    `env` entries set to None are removed from the environment."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                     "--standalone"]
    cmd = launcher + ["-m", "trainer"] + args
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc
