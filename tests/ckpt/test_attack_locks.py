"""Attacks on the lock protocol: one lock (`ckpt.lock`,
`D/run.lock`) that every writer of a run directory or checkpoints root honours, wherever the root
lies. Before: a run whose run directory held another live run's absolute `checkpoint.dir` was not
refused (with `checkpoint.overwrite=true` it deleted the live run's checkpoints), and
`python -m ckpt ... --overwrite` replaced a live run's checkpoint directory while it saved there.

A live run is stood in for by a process that holds the lock exactly as `python -m trainer` does
(`ckpt.lock.hold`); tests/trainer/test_attack_checkpoint_dir.py runs real trainers."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

import ckpt.destination
from ckpt.__main__ import main
from ckpt.destination import DestinationError, staged
from ckpt.paths import TRACKER
from tests.ckpt.cli import refused
from tests.conftest import FAST, held_elsewhere
from tests.module_runs import run_module


def _live_root(root: Path, tmp_path: Path) -> Path:
    """A copy of the test module's checkpoints root, as a live run's `checkpoint.dir`."""
    return shutil.copytree(root, tmp_path / "X" / "checkpoints")


def _listing(directory: Path) -> list[str]:
    """Every path under `directory` (its lock file aside: the holder made it)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.name != "run.lock")


@pytest.mark.parametrize("command", ["export-hf", "export", "reshape"])
def test_overwrite_of_a_live_runs_checkpoint_dir_is_refused(root: Path, tmp_path: Path, capsys,
                                                           command: str) -> None:
    """The attack: `export-hf base live/checkpoints --overwrite` while the trainer saves there."""
    live = _live_root(root, tmp_path)
    before = _listing(live)
    extra = {"export": ["--format", "zarr"], "reshape": ["--target-tp", "2"]}.get(command, [])
    with held_elsewhere(live) as holder:
        refused(capsys, [command, str(root), str(live), "--overwrite", *extra],
                 f"{live} is in use by pid {holder.pid} on", "choose another DST")
    assert _listing(live) == before
    assert sorted(p.name for p in live.parent.iterdir()) == ["checkpoints"]  # no .tmp-PID


def test_a_dst_around_or_inside_a_live_directory_is_refused(root: Path, tmp_path: Path,
                                                          capsys) -> None:
    live = _live_root(root, tmp_path)
    with held_elsewhere(live) as holder:
        # replacing a directory that holds the live one (its run directory, say)
        refused(capsys, ["export-hf", str(root), str(live.parent), "--overwrite"],
                 f"{live}, inside {live.parent}, is in use by pid {holder.pid}")
        # a new DST inside the live root (its next save, or checkpoint.overwrite, removes it)
        refused(capsys, ["export-hf", str(root), str(live / "iter_0000100")],
                 f"lies inside {live}, in use by pid {holder.pid}")
    assert not (live / "iter_0000100").exists()
    assert main(["export-hf", str(root), str(live.parent), "--overwrite"]) == 0  # released


def test_a_dst_taken_by_a_run_while_the_command_writes_is_kept(tmp_path: Path) -> None:
    """A training run starts into DST while a conversion stages it: the commit checks again."""
    dst = tmp_path / "dst"
    with ExitStack() as stack:
        with pytest.raises(DestinationError, match="took it while this command ran"):  # noqa: PT012
            with staged(dst, overwrite=True) as tmp:
                (tmp / "ours").write_text("ours")
                stack.enter_context(held_elsewhere(dst))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no .dst.tmp-PID
        assert sorted(p.name for p in dst.iterdir()) == ["run.lock"]  # the run's, untouched


def _claim_in_child(run_dir: str, checkpoint_dir: str, result: Any, stay: Any) -> None:
    """In a child process: what `python -m trainer hydra.run.dir=RUN checkpoint.dir=CKPT`
    claims; "claimed" or the refusal into `result`, then, once claimed, wait while `stay`."""
    from omegaconf import OmegaConf

    from trainer.run_dir import RunDirError, hold, hold_checkpoints

    cfg = OmegaConf.create({"checkpoint": {"dir": checkpoint_dir, "save": True}})
    try:
        hold(Path(run_dir))
        hold_checkpoints(cfg, Path(run_dir))
    except RunDirError as e:
        result.put(f"error: {e}")
        return
    result.put("claimed")
    while stay.is_set():
        time.sleep(0.05)


@contextmanager
def _claiming(run_dir: Path, checkpoint_dir: str, stay: bool = False) -> Iterator[
        tuple[str, mp.Process]]:
    """What the claim of `run_dir` and `checkpoint_dir` says, in a process of its own (a lock
    lasts as long as its process; a fork, as `held`), kept alive inside the block if `stay`."""
    context = mp.get_context("fork")
    result, staying = context.Queue(), context.Event()
    if stay:
        staying.set()
    proc = context.Process(target=_claim_in_child,
                           args=(str(run_dir), checkpoint_dir, result, staying))
    proc.start()
    try:
        yield result.get(timeout=120), proc
    finally:
        proc.kill()
        proc.join()


def _claim(run_dir: Path, checkpoint_dir: str) -> str:
    with _claiming(run_dir, checkpoint_dir) as (said, _):
        return said


def test_a_run_dir_holding_a_live_runs_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    """Run Y (`hydra.run.dir=W/Y checkpoint.dir=W/X/checkpoints`) is live; run X
    (`hydra.run.dir=W/X`, the default `checkpoint.dir=checkpoints`) must not take W/X/checkpoints.
    Before: `hold_checkpoints` returned early for a root inside the run directory."""
    live = tmp_path / "X" / "checkpoints"
    with held_elsewhere(tmp_path / "Y", live) as y:
        claimed = _claim(tmp_path / "X", "checkpoints")
        assert f"checkpoint.dir {live} is in use by pid {y.pid} on" in claimed, claimed
        # ... and the other way round: Y's root inside X's run directory, X live
    with held_elsewhere(tmp_path / "X") as x:
        claimed = _claim(tmp_path / "Y", str(live))
        assert f"lies in {tmp_path / 'X'}, a directory in use by pid {x.pid}" in claimed, claimed
    assert _claim(tmp_path / "X", "checkpoints") == "claimed"  # all released


@pytest.mark.slow  # a real `python -m trainer` (tens of seconds): CI runs it
def test_the_attack_with_overwrite_keeps_the_live_runs_checkpoints(root: Path,
                                                                  tmp_path: Path) -> None:
    """`python -m trainer hydra.run.dir=W/X checkpoint.overwrite=true` while run Y saves into
    W/X/checkpoints: it used to exit 0 after removing Y's checkpoints."""
    live = _live_root(root, tmp_path)
    before = _listing(live)
    with held_elsewhere(tmp_path / "Y", live) as y:
        proc = run_module("trainer", [*FAST, "trainer.max_steps=2", "hydra.run.dir=X",
                                      "checkpoint.overwrite=true"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint.dir {live} is in use by pid {y.pid} on" in errors[0]
    assert _listing(live) == before and (live / TRACKER).read_text().strip() == "4"


def test_the_lock_of_a_checkpoint_dir_inside_the_run_dir_is_taken(tmp_path: Path) -> None:
    """One protocol wherever the root lies: a run locks its `checkpoint.dir` inside its own run
    directory too, so that another run's absolute `checkpoint.dir` there is refused."""
    from ckpt import lock

    with _claiming(tmp_path / "X", "checkpoints", stay=True) as (said, proc):
        assert said == "claimed"
        assert lock.holder(tmp_path / "X").startswith(f"pid {proc.pid} on")
        assert lock.holder(tmp_path / "X" / "checkpoints") == lock.holder(tmp_path / "X")
    assert lock.holder(tmp_path / "X" / "checkpoints") is None  # the OS released it


def test_export_hf_of_a_live_root_as_source_still_works(root: Path, tmp_path: Path) -> None:
    """Reading a live run's checkpoints is fine: only writers honour the lock."""
    live = _live_root(root, tmp_path)
    with held_elsewhere(live):
        assert main(["export-hf", str(live), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert ckpt.destination.written == [tmp_path / "hf"]
