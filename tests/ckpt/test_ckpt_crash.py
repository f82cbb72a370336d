"""Crash safety of training saves: a run SIGKILLed mid-save, and a killed writer process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from ckpt.__main__ import main
from ckpt.paths import checkpoint_name, resolve_checkpoint
from tests.conftest import FAST, alive, compose_config, read_metrics
from tests.module_runs import ModuleRun, start_module
from trainer.train import Trainer

pytestmark = pytest.mark.slow

# 150 MB checkpoints: a save takes long enough (~0.5 s) to be caught in the middle.
BIG = ["model.hidden_size=512", "model.num_layers=4", "model.ffn_hidden_size=1536"]


def _start(args: list[str], cwd: Path) -> ModuleRun:
    """`python -m trainer args` in its own session (so a kill of its group reaches megatron's
    writer processes too, as a job kill would), forked from the preloaded server."""
    return start_module("trainer", args, cwd, new_session=True)


def save_in_progress(root: Path, proc: ModuleRun, timeout: float = 300) -> Path:
    """The `iter_*.tmp` directory of a save after the first, once it holds a file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("the run ended before a save could be interrupted:\n"
                                 + "\n".join(proc.output())[-3000:])
        for tmp in root.glob("iter_*.tmp"):
            if tmp.name != checkpoint_name(1) + ".tmp" and any(tmp.iterdir()):
                return tmp
        time.sleep(0.002)
    raise TimeoutError(f"no save started under {root}")


def test_sigkill_mid_save_keeps_the_previous_checkpoint_and_resume_works(run_training,
                                                                          tmp_path: Path) -> None:
    root = tmp_path / "killed" / "checkpoints"
    args = FAST + BIG + ["trainer.max_steps=6", "trainer.save_interval=1", "hydra.run.dir=killed"]
    proc = _start(args, tmp_path)
    try:
        partial = save_in_progress(root, proc)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    step = int(partial.name.removeprefix("iter_").removesuffix(".tmp"))
    assert partial.is_dir() and not (root / checkpoint_name(step)).exists()
    assert resolve_checkpoint(root) == root / checkpoint_name(step - 1)
    assert main(["verify", str(root)]) == 0

    # Resume from the root (its latest complete checkpoint) and redo the interrupted step and
    # save: same loss as the killed run logged, and the partial directory replaced.
    logged = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "killed")}
    resumed = run_training(BIG + [f"trainer.max_steps={step}", "trainer.save_interval=1",
                                  f"checkpoint.load={root}", f"checkpoint.dir={root}"],
                           name="resumed")
    assert [r["step"] for r in resumed] == [step] and resumed[0]["loss"] == logged[step]
    assert not partial.exists() and resolve_checkpoint(root) == root / checkpoint_name(step)


def writer_alive(proc: ModuleRun, timeout: float = 300) -> list[psutil.Process]:
    """Every process of `proc`'s tree, once one of megatron's forked writers is among them."""
    me = psutil.Process(proc.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("the run ended before a writer was seen:\n"
                                 + "\n".join(proc.output())[-3000:])
        try:
            tree = me.children(recursive=True)
            if any(p.ppid() == proc.pid and p.cmdline() == me.cmdline() for p in tree):
                return tree
        except psutil.NoSuchProcess:  # a writer finished while we looked
            pass
        time.sleep(0.002)
    raise TimeoutError("no writer process seen")


def test_sigkill_of_a_rank_mid_save_leaves_no_process_behind(tmp_path: Path) -> None:
    args = FAST + BIG + ["trainer.max_steps=50", "trainer.save_interval=1", "hydra.run.dir=run"]
    proc = _start(args, tmp_path)  # its own session, so a failure below can clean up after it
    tree: list[psutil.Process] = []
    try:
        tree = writer_alive(proc)
        os.kill(proc.pid, signal.SIGKILL)  # the rank only, as an OOM killer would
        proc.wait()
        deadline = time.monotonic() + 3
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in alive(tree)]
        assert not left, f"left behind after SIGKILL of the rank: {left}"
    finally:
        for p in alive(tree):
            p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _killed(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_killed_writer_process_fails_the_save_instead_of_hanging(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(compose_config(FAST + [f"checkpoint.dir={tmp_path / 'ckpt'}"]), tmp_path)
    try:
        trainer.save()  # step 0: complete
        # megatron writes each file in a forked process; this one dies as the OOM killer would.
        monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(_killed))
        trainer.step = 1
        with pytest.raises(RuntimeError, match="killed by signal 9 while writing .*0001.tmp"):
            trainer.save()
    finally:
        trainer.close()
    root = tmp_path / "ckpt"
    assert resolve_checkpoint(root) == root / checkpoint_name(0)
    assert (root / (checkpoint_name(1) + ".tmp")).is_dir()
