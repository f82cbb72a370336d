"""A signal mid-training (preemption, `timeout`, torchrun's shutdown) saves the current step and
exits 128 + signal; resuming from that checkpoint continues the run exactly. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckpt.__main__ import main as ckpt_main
from ckpt.paths import TRACKER, checkpoint_name
from tests.conftest import FAST, own_session, read_metrics
from tests.module_runs import ModuleRun, run_module, start_module

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _training(proc: subprocess.Popen | ModuleRun, run_dir: Path, steps: int,
              timeout: float = 180) -> None:
    """Wait until `proc` has logged `steps` training steps into `run_dir`."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the signal"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir} did not log {steps} steps")


def _stopped_at(run_dir: Path) -> int:
    """The step the stopped run saved: its tracker, its last logged step and its checkpoint."""
    root = run_dir / "checkpoints"
    step = int((root / TRACKER).read_text())
    assert read_metrics(run_dir)[-1]["step"] == step
    assert ckpt_main(["verify", str(root / checkpoint_name(step))]) == 0
    return step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_the_step_and_the_resume_continues_exactly(
        run_training, tmp_path: Path, sig: signal.Signals) -> None:
    # A constant lr: the stopped run's schedule (100,000 steps) and the short runs' agree.
    constant = ["trainer.lr_decay_style=constant"]
    args = FAST + constant + ["trainer.max_steps=100000", "trainer.save_interval=0",
                              "hydra.run.dir=run"]
    proc = start_module("trainer", args, tmp_path)  # forked from the preloaded server
    try:
        _training(proc, tmp_path / "run", 3)
        proc.send_signal(sig)
        output = "".join(proc.communicate(timeout=120))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, output[-3000:]
    step = _stopped_at(tmp_path / "run")
    assert f"stopped by {sig.name} after step {step}: saving before exit" in output
    assert "resume with checkpoint.load=" in output

    root = tmp_path / "run" / "checkpoints"
    resumed = run_training(constant + [f"trainer.max_steps={step + 2}", f"checkpoint.load={root}",
                                       "checkpoint.save=false"], name="resumed")
    straight = run_training(constant + [f"trainer.max_steps={step + 2}", "checkpoint.save=false"],
                            name="straight")
    assert [r["step"] for r in resumed] == [step + 1, step + 2]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[step:]]


def test_under_torchrun_a_signal_to_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    args = FAST + ["parallel.tp=2", "trainer.max_steps=100000",
                   "trainer.save_interval=0", "hydra.run.dir=run"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "trainer", *args]
    log = tmp_path / "torchrun.log"
    with own_session(cmd, tmp_path, log, ENV) as proc:
        _training(proc, tmp_path / "run", 2)
        rank1 = next(p for p in psutil.Process(proc.pid).children()
                     if p.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGTERM)  # rank 0 gets no signal: it learns it from rank 1
        proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode != 0, output[-3000:]
    assert "exitcode  : 143" in output, output[-3000:]
    step = _stopped_at(tmp_path / "run")
    assert f"stopped by SIGTERM after step {step}" in output


def test_a_second_signal_ends_the_process_at_once(tmp_path: Path) -> None:
    proc = run_module("tests.trainer.second_signal", [], tmp_path, timeout=60)  # forked
    assert proc.stdout == f"recorded {int(signal.SIGTERM)}\n"
    assert proc.returncode == -signal.SIGTERM
