"""Attacks on the lock protocol (issue 31, hostile run items 1 and 2): one lock (`ckpt.lock`,
`D/run.lock`) that every writer of a run directory or checkpoints root honours, wherever the root
lies. Before: a run whose run directory held another live run's absolute `checkpoint.dir` was not
refused (with `checkpoint.overwrite=true` it deleted the live run's checkpoints), and
`python -m ckpt ... --overwrite` replaced a live run's checkpoint directory while it saved there.

A live run is stood in for by a process that holds the lock exactly as `python -m trainer` does
(`ckpt.lock.hold`); tests/trainer/test_attack_checkpoint_dir.py runs real trainers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

import ckpt.destination
from ckpt.__main__ import main
from ckpt.destination import DestinationError, staged
from ckpt.paths import TRACKER
from tests.conftest import FAST, REPO

_HOLDER = """
import sys, time
from pathlib import Path
from ckpt.lock import hold
for path in sys.argv[1:]:
    hold(Path(path))
print("held", flush=True)
time.sleep(600)
"""


@contextmanager
def held(*directories: Path) -> Iterator[subprocess.Popen]:
    """Another process holding `directories` as a running job does."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, *map(str, directories)],
                            stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def _live_root(root: Path, tmp_path: Path) -> Path:
    """A copy of the session's checkpoints root, as a live run's `checkpoint.dir`."""
    return shutil.copytree(root, tmp_path / "X" / "checkpoints")


def _listing(directory: Path) -> list[str]:
    """Every path under `directory` (its lock file aside: the holder made it)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.name != "run.lock")


def _refused(capsys: pytest.CaptureFixture, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("command", ["export-hf", "export", "reshape"])
def test_overwrite_of_a_live_runs_checkpoint_dir_is_refused(root: Path, tmp_path: Path, capsys,
                                                           command: str) -> None:
    """The attack: `export-hf base live/checkpoints --overwrite` while the trainer saves there."""
    live = _live_root(root, tmp_path)
    before = _listing(live)
    extra = {"export": ["--format", "zarr"], "reshape": ["--target-tp", "2"]}.get(command, [])
    with held(live) as holder:
        _refused(capsys, [command, str(root), str(live), "--overwrite", *extra],
                 f"{live} is in use by pid {holder.pid} on", "choose another DST")
    assert _listing(live) == before
    assert sorted(p.name for p in live.parent.iterdir()) == ["checkpoints"]  # no .tmp-PID


def test_a_dst_around_or_inside_a_live_directory_is_refused(root: Path, tmp_path: Path,
                                                          capsys) -> None:
    live = _live_root(root, tmp_path)
    with held(live) as holder:
        # replacing a directory that holds the live one (its run directory, say)
        _refused(capsys, ["export-hf", str(root), str(live.parent), "--overwrite"],
                 f"{live}, inside {live.parent}, is in use by pid {holder.pid}")
        # a new DST inside the live root (its next save, or checkpoint.overwrite, removes it)
        _refused(capsys, ["export-hf", str(root), str(live / "iter_0000100")],
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
                stack.enter_context(held(dst))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no .dst.tmp-PID
        assert sorted(p.name for p in dst.iterdir()) == ["run.lock"]  # the run's, untouched


_CLAIM = """
import sys
from pathlib import Path
from omegaconf import OmegaConf
from trainer.run_dir import RunDirError, hold, hold_checkpoints
cfg = OmegaConf.create({"checkpoint": {"dir": sys.argv[2], "save": True}})
try:
    hold(Path(sys.argv[1]))
    hold_checkpoints(cfg, Path(sys.argv[1]))
except RunDirError as e:
    print(f"error: {e}")
    sys.exit(2)
print("claimed")
"""


def _claim(run_dir: Path, checkpoint_dir: str) -> subprocess.CompletedProcess:
    """What `python -m trainer hydra.run.dir=RUN checkpoint.dir=CKPT` claims, in a process of
    its own (a lock lasts as long as its process)."""
    return subprocess.run([sys.executable, "-c", _CLAIM, str(run_dir), checkpoint_dir],
                          capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})


def test_a_run_dir_holding_a_live_runs_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    """Run Y (`hydra.run.dir=W/Y checkpoint.dir=W/X/checkpoints`) is live; run X
    (`hydra.run.dir=W/X`, the default `checkpoint.dir=checkpoints`) must not take W/X/checkpoints.
    Before: `hold_checkpoints` returned early for a root inside the run directory."""
    live = tmp_path / "X" / "checkpoints"
    with held(tmp_path / "Y", live) as y:
        claimed = _claim(tmp_path / "X", "checkpoints")
        assert claimed.returncode == 2, claimed.stdout + claimed.stderr
        assert f"checkpoint.dir {live} is in use by pid {y.pid} on" in claimed.stdout
        # ... and the other way round: Y's root inside X's run directory, X live
    with held(tmp_path / "X") as x:
        claimed = _claim(tmp_path / "Y", str(live))
        assert claimed.returncode == 2, claimed.stdout + claimed.stderr
        assert f"lies in {tmp_path / 'X'}, a directory in use by pid {x.pid}" in claimed.stdout
    assert _claim(tmp_path / "X", "checkpoints").stdout.strip() == "claimed"  # all released


@pytest.mark.slow  # a real `python -m trainer` (tens of seconds): CI runs it
def test_the_attack_with_overwrite_keeps_the_live_runs_checkpoints(root: Path,
                                                                  tmp_path: Path) -> None:
    """`python -m trainer hydra.run.dir=W/X checkpoint.overwrite=true` while run Y saves into
    W/X/checkpoints: it used to exit 0 after removing Y's checkpoints."""
    live = _live_root(root, tmp_path)
    before = _listing(live)
    with held(tmp_path / "Y", live) as y:
        proc = subprocess.run([sys.executable, "-m", "trainer", *FAST, "trainer.max_steps=2",
                               "hydra.run.dir=X", "checkpoint.overwrite=true"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint.dir {live} is in use by pid {y.pid} on" in errors[0]
    assert _listing(live) == before and (live / TRACKER).read_text().strip() == "4"


def test_the_lock_of_a_checkpoint_dir_inside_the_run_dir_is_taken(tmp_path: Path) -> None:
    """One protocol wherever the root lies: a run locks its `checkpoint.dir` inside its own run
    directory too, so that another run's absolute `checkpoint.dir` there is refused."""
    from ckpt import lock

    stays = _CLAIM.replace('print("claimed")', 'print("claimed", flush=True)\n'
                                               'import time; time.sleep(600)')
    proc = subprocess.Popen([sys.executable, "-c", stays, str(tmp_path / "X"), "checkpoints"],
                            stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "claimed"
        assert lock.holder(tmp_path / "X").startswith(f"pid {proc.pid} on")
        assert lock.holder(tmp_path / "X" / "checkpoints") == lock.holder(tmp_path / "X")
    finally:
        proc.kill()
        proc.communicate()
    assert lock.holder(tmp_path / "X" / "checkpoints") is None  # the OS released it


def test_export_hf_of_a_live_root_as_source_still_works(root: Path, tmp_path: Path) -> None:
    """Reading a live run's checkpoints is fine: only writers honour the lock."""
    live = _live_root(root, tmp_path)
    with held(live):
        assert main(["export-hf", str(live), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert ckpt.destination.written == [tmp_path / "hf"]
