"""Attacks on the training run's `checkpoint.dir` (issue 31, rows 1, 10 and 11): shared between two
runs, read-only, full at a save. Start the next attack here (the checkpoint tools' file-system
attacks are in tests/ckpt/test_attack_filesystem.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpt.save
from ckpt import disk
from ckpt.__main__ import main as ckpt_main
from ckpt.paths import TRACKER
from tests.conftest import FAST, compose_config
from trainer.errors import UserError
from trainer.train import train


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=cwd,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_a_checkpoint_dir_in_use_is_refused_whatever_the_run_dir(tmp_path: Path) -> None:
    """Before: the lock covered the run directory only; two runs wrote one checkpoints root and
    each one's saves corrupted the other's."""
    shared = tmp_path / "shared_checkpoints"  # absolute: outside both run directories
    holder = _start(FAST + ["trainer.max_steps=100000", "trainer.save_interval=0",
                            "hydra.run.dir=a", f"checkpoint.dir={shared}"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "a" / "metrics.jsonl").exists():  # the holder is training
            assert holder.poll() is None and time.monotonic() < deadline, holder.communicate()
            time.sleep(0.5)
        second = _start(FAST + ["trainer.max_steps=2", "hydra.run.dir=b",
                                f"checkpoint.dir={shared}"], tmp_path)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2, err[-3000:]
        assert err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
        assert f"checkpoint.dir {shared} is in use by pid {holder.pid} on" in err
        assert not (tmp_path / "b" / "metrics.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()


def test_a_read_only_checkpoint_dir_is_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: it trained, then the first save failed with an OSError traceback. A read-only file
    system is simulated: creating anything under it fails with EROFS (root ignores modes)."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(real):
        def call(path, *args, **kwargs):
            if str(read_only) in os.fsdecode(path):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refuse(real_open))
    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    with pytest.raises(UserError, match=r"checkpoint.dir=.*ro/checkpoints is not writable "
                                        r"\(Read-only file system\)"):
        train(compose_config(FAST + ["trainer.max_steps=2",
                                     f"checkpoint.dir={read_only / 'checkpoints'}"]), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()  # no step was trained


def test_a_checkpoint_that_cannot_fit_is_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "free_bytes", lambda path: 2**20)
    with pytest.raises(UserError, match="one checkpoint will not fit .* has 1.0 MB free"):
        train(compose_config(FAST + ["trainer.max_steps=2",
                                     f"checkpoint.dir={tmp_path / 'checkpoints'}"]), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_disk_full_during_a_save_is_named_and_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a traceback `unexpected pos 704 vs 598` (torch's zip writer on ENOSPC), no word of
    the disk, and `iter_N.tmp` left behind. The disk fills up during the second save."""
    real_save = ckpt.save.dist_checkpointing.save
    saves: list[str] = []

    def save_until_full(state, directory, **kwargs):
        saves.append(directory)
        if len(saves) == 1:
            return real_save(state, directory, **kwargs)
        (Path(directory) / "common.pt").write_bytes(b"PK partial")
        monkeypatch.setattr(disk, "free_bytes", lambda path: 0)
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt.save.dist_checkpointing, "save", save_until_full)
    root = tmp_path / "checkpoints"
    with pytest.raises(ckpt.save.DiskFullError) as raised:  # a CheckpointError: one error line
        train(compose_config(FAST + ["trainer.max_steps=4", "trainer.save_interval=2",
                                     f"checkpoint.dir={root}"]), tmp_path)
    message = str(raised.value)
    assert "no space left on device (ENOSPC) while saving iter_0000004.tmp" in message
    assert f"the previous checkpoint ({root / 'iter_0000002'}) is intact" in message
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", TRACKER]
    assert (root / TRACKER).read_text().strip() == "2"
    assert ckpt_main(["verify", str(root)]) == 0


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_a_checkpoint_dir_inside_another_runs_directory_is_refused(tmp_path: Path) -> None:
    """Run A keeps its checkpoints in its run directory (the default `checkpoints`); run B points
    its absolute `checkpoint.dir` there."""
    from trainer.run_dir import RunDirError, hold_checkpoints

    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path; "
         "from trainer.run_dir import hold; hold(Path('a')); print('held', flush=True); "
         "time.sleep(600)"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = compose_config([f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}"])
        with pytest.raises(RunDirError, match=rf"lies in the run directory {tmp_path / 'a'}, in "
                                              rf"use by pid {holder.pid} on"):
            hold_checkpoints(cfg, tmp_path / "b")
    finally:
        holder.kill()
        holder.communicate()
