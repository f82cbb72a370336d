"""One run per run directory, and no run that silently mixes with another's checkpoints.

- Rank 0 holds `run.lock` (`ckpt.lock`: an `fcntl.flock`, holding its pid and host) for the
  process's life: the OS releases it on any exit, SIGKILL included, so it is never stale; a
  second run into the directory is refused naming the holder. `checkpoint.dir` gets the same
  lock wherever it lies (inside the run directory too), and one inside a directory another
  process holds is refused: two runs with one checkpoints root would corrupt each other's saves,
  and `checkpoint.overwrite` would remove the other's. `python -m ckpt` commands honour the
  same locks. `trainer.eval` holds its own run directory and refuses a training run's.
- The run directory must be writable with space left, `checkpoint.dir` writable (checked on
  every rank before anything is built).
- A run into a directory whose `checkpoint.dir` holds checkpoints must resume from the newest of
  them, or say `checkpoint.overwrite=true`: then every checkpoint after the step it starts at
  (all of them for a fresh run) is removed first, so the tracker never moves back while stale
  `iter_*` stay.

`python -m trainer` claims the directory in a Hydra callback (`ClaimRunDir`), before Hydra
writes `.hydra/` or the log there; a refused run writes nothing into the directory and raises
its `UserError` when the job starts (`raise_refusal`), on every rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from ckpt import disk, lock
from ckpt.disk import human_bytes
from ckpt.paths import TRACKER, checkpoint_name, resolve_checkpoint
from trainer.errors import UserError

log = logging.getLogger(__name__)

_refusal: list[UserError] = []


class RunDirError(UserError):
    """The run directory is in use, or holds checkpoints this run would mix with."""


def hold(run_dir: Path, name: str = "run directory", setting: str = "hydra.run.dir") -> None:
    """Take the directory's lock (`ckpt.lock`) for the rest of this process, or raise naming
    its holder (`name` and `setting`: what the message calls the directory and the setting to
    change); a directory that cannot be created or written is refused."""
    try:
        lock.hold(run_dir)
    except lock.InUse as e:
        raise RunDirError(f"{name} {e.directory} is in use by {e.holder}: choose another "
                          f"{setting}, or wait for that run to end") from None
    except OSError as e:
        raise RunDirError(f"{setting}={run_dir.absolute()} is not writable ({e.strerror}): "
                          f"choose a writable {setting}") from None


def check_space(run_dir: Path) -> None:
    """Refuse a run directory on a read-only or full file system (its config, log and metrics
    would fail to be written, each with a traceback)."""
    above = run_dir.absolute()
    while not above.exists() and above != above.parent:
        above = above.parent
    if os.statvfs(above).f_flag & os.ST_RDONLY:
        raise RunDirError(f"hydra.run.dir={run_dir.absolute()} is not writable (Read-only file "
                          "system): choose a writable hydra.run.dir")
    free = disk.free_bytes(run_dir)
    if free < disk.LOW_WATER_BYTES:
        raise RunDirError(f"hydra.run.dir={run_dir.absolute()}: its file system is full "
                          f"({human_bytes(free)} free): free space, or choose another "
                          "hydra.run.dir")


def checkpoints_root(cfg: DictConfig, run_dir: Path) -> Path:
    root = Path(cfg.checkpoint.dir)
    return root if root.is_absolute() else run_dir / root


def check_writable(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse a `checkpoint.dir` this process cannot create files in (a read-only file system,
    no permission) before any step is trained, rather than at the first save."""
    if not cfg.checkpoint.save:
        return
    root = checkpoints_root(cfg, run_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunDirError(f"checkpoint.dir={root} is not writable ({e.strerror}): choose a "
                          "writable checkpoint.dir, or set checkpoint.save=false") from None


def hold_checkpoints(cfg: DictConfig, run_dir: Path) -> None:
    """Lock `checkpoint.dir` wherever it lies (inside the run directory too: another run may
    have chosen it as its own absolute `checkpoint.dir`), after refusing one inside a directory
    another process holds."""
    if not cfg.checkpoint.save:
        return
    check_writable(cfg, run_dir)
    root = checkpoints_root(cfg, run_dir).absolute()
    if above := lock.held_above(root):
        raise RunDirError(f"checkpoint.dir {root} lies in {above[0]}, a directory in use by "
                          f"{above[1]}: choose another checkpoint.dir, or wait for that run to "
                          "end")
    hold(root, "checkpoint.dir", "checkpoint.dir")


def saved_steps(root: Path) -> list[int]:
    """Steps of the `iter_*` directories under `root` (complete or not; not `.tmp`/`.old`)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if re.fullmatch(r"iter_\d+", p.name))


def check_checkpoints(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse a run whose saves would mix with the checkpoints already in `checkpoint.dir`."""
    root = checkpoints_root(cfg, run_dir)
    steps = saved_steps(root)
    if not steps and not (root / TRACKER).exists():
        return
    if cfg.checkpoint.overwrite or not cfg.checkpoint.save:
        return
    newest = steps[-1] if steps else 0
    if not cfg.checkpoint.load:
        raise RunDirError(
            f"{root} already holds checkpoints (up to step {newest}): resume them with "
            f"checkpoint.load={root}, replace them with checkpoint.overwrite=true, or choose "
            "another hydra.run.dir")
    try:
        start = resolve_checkpoint(cfg.checkpoint.load)
    except (FileNotFoundError, ValueError):
        return  # the trainer reports the load path itself
    if start.parent.resolve() != root.resolve() or int(start.name[5:]) < newest:
        raise RunDirError(
            f"{root} holds checkpoints up to step {newest} that resuming {start} would mix "
            f"with: load {root} (its newest), or drop them with checkpoint.overwrite=true")


def drop_checkpoints_after(root: Path, step: int) -> None:
    """`checkpoint.overwrite`: remove every checkpoint after `step` (and any partial save), and
    point the tracker at the newest one kept."""
    for path in list(root.iterdir()) if root.is_dir() else []:
        match = re.fullmatch(r"iter_(\d+)(\.tmp|\.old)?", path.name)
        if match and (match[2] or int(match[1]) > step):
            shutil.rmtree(path)
    kept = saved_steps(root)
    tracker = root / TRACKER
    if kept and (root / checkpoint_name(kept[-1]) / "metadata.json").is_file():
        tmp = root / (TRACKER + ".tmp")
        tmp.write_text(f"{kept[-1]}\n")
        os.replace(tmp, tracker)
    elif tracker.exists():
        tracker.unlink()
    log.warning("checkpoint.overwrite: removed the checkpoints of %s after step %d", root, step)


def check_not_another_jobs(run_dir: Path, job_name: str) -> None:
    """`trainer.eval`: refuse a run directory that holds another job's outputs (a training
    run's `.hydra/`, log, metrics or checkpoints), which Hydra would overwrite."""
    found = [name for name in ("train.log", "metrics.jsonl", "checkpoints")
             if (run_dir / name).exists()]
    if (run_dir / ".hydra").is_dir() and not (run_dir / f"{job_name}.log").is_file():
        found.insert(0, ".hydra/")
    if found:
        raise RunDirError(f"hydra.run.dir={run_dir} holds another job's outputs "
                          f"({', '.join(found)}: a training run's?), whose .hydra/config.yaml "
                          "and overrides.yaml this evaluation would overwrite: choose another "
                          f"hydra.run.dir (e.g. {run_dir}-{job_name})")


class ClaimRunDir(Callback):
    """Hydra callback of `python -m trainer`: lock and check the run directory on rank 0
    before Hydra writes into it; a refusal mutes Hydra's outputs and waits for the job."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        run_dir = Path(str(config.hydra.run.dir)).absolute()
        try:
            self.claim(config, run_dir)
        except RunDirError as e:
            _refusal.append(e)
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None  # keep the holder's .hydra/ and log as they are
                logging_cfg = config.hydra.job_logging
                if "handlers" in logging_cfg and "file" in logging_cfg.handlers:
                    del logging_cfg.handlers["file"]
                    logging_cfg.root.handlers = [h for h in logging_cfg.root.handlers
                                                 if h != "file"]
                if not run_dir.is_dir():  # Hydra would create it (or fail to: read-only)
                    config.hydra.run.dir = os.getcwd()

    def claim(self, config: DictConfig, run_dir: Path) -> None:
        check_space(run_dir)
        hold(run_dir)
        hold_checkpoints(config, run_dir)
        check_checkpoints(config, run_dir)


class ClaimEvalDir(ClaimRunDir):
    """Hydra callback of `python -m trainer.eval`: its run directory is its own (locked), never
    a training run's."""

    def claim(self, config: DictConfig, run_dir: Path) -> None:
        check_not_another_jobs(run_dir, str(config.hydra.job.name))
        check_space(run_dir)
        hold(run_dir)


def raise_refusal() -> None:
    """Raise the refusal `ClaimRunDir` (or `ClaimEvalDir`) recorded on rank 0, on every
    rank."""
    message = [str(_refusal[0]) if _refusal else ""]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if message[0]:
        raise RunDirError(message[0])
