"""Attacks on the training run's `checkpoint.dir`: shared between two
runs, read-only, full at a save. Start the next attack here (the checkpoint tools' file-system
attacks are in tests/ckpt/test_attack_filesystem.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import ckpt.save
from ckpt import disk
from ckpt.__main__ import main as ckpt_main
from ckpt.paths import TRACKER
from tests.conftest import FAST, compose_config, held_elsewhere
from tests.module_runs import ModuleRun, run_module, start_module
from trainer.errors import UserError
from trainer.train import train


def _start(args: list[str], cwd: Path, ctrl_c: bool = False) -> ModuleRun:
    """`python -m trainer args` in `cwd`, forked from the preloaded server (tests/conftest.py);
    `ctrl_c`: taking SIGINT as in a terminal (tests/module_runs.py)."""
    return start_module("trainer", args, cwd, ctrl_c=ctrl_c)


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


def _zip_writer_failure(directory: str) -> BaseException:
    """torch's zip writer on ENOSPC, as `save` raises it in one process."""
    (Path(directory) / "common.pt").write_bytes(b"PK partial")
    return RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 704 vs 598")


def _checkpoint_writer_failure(directory: str) -> BaseException:
    """The same failure in one of torch's checkpoint writers: a `CheckpointException`, a
    BaseException that `except Exception` misses."""
    from torch.distributed.checkpoint.api import CheckpointException

    (Path(directory) / "__0_0.distcp").write_bytes(b"PK partial")
    failure = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . "
                           "unexpected pos 704 vs 598")
    return CheckpointException("write", {0: (failure, None)})


@pytest.mark.parametrize("failure", [_zip_writer_failure, _checkpoint_writer_failure],
                         ids=["zip-writer", "checkpoint-exception"])
def test_a_disk_full_during_a_save_is_named_and_keeps_the_previous_checkpoint(
        failure, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up during the second save: one line that names the disk (not torch's
    `unexpected pos 704 vs 598`), no `iter_N.tmp` left, the first save intact."""
    real_save = ckpt.save.dist_checkpointing.save
    saves: list[str] = []

    def save_until_full(state, directory, **kwargs):
        saves.append(directory)
        if len(saves) == 1:
            return real_save(state, directory, **kwargs)
        monkeypatch.setattr(disk, "free_bytes", lambda path: 0)
        raise failure(directory)

    monkeypatch.setattr(ckpt.save.dist_checkpointing, "save", save_until_full)
    root = tmp_path / "checkpoints"
    with pytest.raises(ckpt.save.DiskFullError) as raised:  # a CheckpointError: one error line
        train(compose_config(FAST + ["trainer.max_steps=4", "trainer.save_interval=2",
                                     f"checkpoint.dir={root}"]), tmp_path)
    message = str(raised.value)
    assert "no space left on device (ENOSPC) while saving iter_0000004.tmp" in message
    assert f"the previous checkpoint ({root / 'iter_0000002'}) is intact" in message
    assert "(RuntimeError: " in message and "\n" not in message  # the writer's own words too
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", TRACKER]
    assert (root / TRACKER).read_text().strip() == "2"
    assert ckpt_main(["verify", str(root)]) == 0


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_a_checkpoint_dir_inside_another_runs_directory_is_refused(tmp_path: Path) -> None:
    """Run A keeps its checkpoints in its run directory (the default `checkpoints`); run B points
    its absolute `checkpoint.dir` there."""
    from trainer.run_dir import RunDirError, hold_checkpoints

    with held_elsewhere(tmp_path / "a", as_run_dir=True) as holder:
        cfg = compose_config([f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}"])
        with pytest.raises(RunDirError, match=rf"lies in {tmp_path / 'a'}, a directory in use "
                                              rf"by pid {holder.pid} on"):
            hold_checkpoints(cfg, tmp_path / "b")


def test_a_second_ctrl_c_during_a_save_removes_the_partial_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first Ctrl-C asks for a save and a stop; a second one ends the process at once as
    KeyboardInterrupt, which `python -m trainer` reports in one line; it must not leave the
    `iter_N.tmp` it cut short."""
    real_save = ckpt.save.dist_checkpointing.save
    saves: list[str] = []

    def interrupted(state, directory, **kwargs):
        saves.append(directory)
        real_save(state, directory, **kwargs)
        if len(saves) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.save.dist_checkpointing, "save", interrupted)
    root = tmp_path / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        train(compose_config(FAST + ["trainer.max_steps=4", "trainer.save_interval=2",
                                     f"checkpoint.dir={root}"]), tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", TRACKER]


def test_a_sigint_a_shell_ignores_stays_ignored() -> None:
    """A job started in the background (`cmd &` in a script) ignores SIGINT: training must not
    start stopping on it."""
    from trainer.stop import StopOnSignal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = StopOnSignal()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._record
        stop.uninstall()
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow  # a real `python -m trainer` run: CI runs it
def test_ctrl_c_saves_the_step_and_stops_in_one_line(tmp_path: Path) -> None:
    """Before: an 80-line KeyboardInterrupt traceback and an `iter_N.tmp` left. SIGINT is now
    what SIGTERM is: the step is saved and the run stops, exit 130."""
    proc = _start(FAST + ["trainer.max_steps=100000", "trainer.save_interval=0",
                          "hydra.run.dir=run"], tmp_path, ctrl_c=True)
    try:
        deadline = time.monotonic() + 180
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = out + err  # the log goes to stdout
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "stopped by SIGINT after step" in output and "resume with checkpoint.load=" in output
    root = tmp_path / "run" / "checkpoints"
    assert not list(root.glob("*.tmp"))
    assert ckpt_main(["verify", str(root)]) == 0


@pytest.mark.slow  # a real `python -m trainer` entry point: CI runs it
def test_ctrl_c_before_training_is_one_line(tmp_path: Path) -> None:
    """The entry point's `main` in a process of its own, forked from the preloaded server
    (tests/trainer/interrupted_setup.py: its `train` interrupted while the model is built)."""
    proc = run_module("tests.trainer.interrupted_setup", [*FAST, "hydra.run.dir=run"], tmp_path,
                      timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: interrupted by SIGINT")
    assert f"checkpoint.load={tmp_path / 'run' / 'checkpoints'}" in errors[0]


def test_a_read_only_or_full_run_dir_is_refused(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: Hydra's `OSError: [Errno 28] No space left on device` (or EROFS) while saving
    `.hydra/config.yaml`, with a traceback. The run directory's claim refuses both first."""
    from trainer.run_dir import RunDirError, check_space, hold

    monkeypatch.setattr(disk, "free_bytes", lambda path: 4096)
    with pytest.raises(RunDirError, match=r"hydra.run.dir=.*/run: its file system is full "
                                          r"\(4.1 KB free\): free space, or choose another"):
        check_space(tmp_path / "run")
    monkeypatch.undo()
    check_space(tmp_path / "run")
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if "ro" in Path(path).parts:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(RunDirError, match=r"hydra.run.dir=.*/ro/run is not writable "
                                          r"\(Read-only file system\): choose a writable"):
        hold(tmp_path / "ro" / "run")
    assert not (tmp_path / "ro").exists()


@pytest.mark.slow  # real `python -m trainer` runs: CI runs it
@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_the_command_line_refuses_a_read_only_or_full_run_dir(tmp_path: Path, kind: str) -> None:
    """The whole command line on a real file system of each kind (a tmpfs: root only)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    options = "ro,size=64k" if kind == "read-only" else "size=64k"
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                                            str(mount)], capture_output=True).returncode:
        pytest.skip("needs root and a tmpfs mount")
    try:
        if kind == "full":
            with open(mount / "fill", "wb") as f:
                with pytest.raises(OSError):
                    f.write(b"x" * (1 << 20))
                    f.flush()
        proc = _start(FAST + ["trainer.max_steps=2", f"hydra.run.dir={mount / 'run'}",
                              f"checkpoint.dir={tmp_path / 'checkpoints'}"], tmp_path)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: hydra.run.dir="), err
        assert ("Read-only file system" if kind == "read-only" else "file system is full") in err
        assert not (mount / "run").exists()
    finally:
        subprocess.run(["umount", str(mount)], check=True)
