"""Save a training checkpoint crash-safely (megatron `dist_checkpointing`, torch_dist backend).

A save goes to `iter_XXXXXXX.tmp/`, gets its checksum manifest (`ckpt.checksums`) last, is
fsynced and renamed when every rank has written, and only then the tracker moves, so a crash
(even SIGKILL) mid-save leaves the previous checkpoint as the one that loads. If one of
megatron's writer processes dies, the save fails instead of hanging; the writers die with the
rank that forked them, and no Manager process is started (`_collect_results_in_process`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.checksums import checkpoint_files, digests, write_manifest
from ckpt.disk import failure_text, ran_out_of_space
from ckpt.meta import CheckpointMeta
from ckpt.paths import TRACKER, checkpoint_name
from ckpt.reader import CheckpointError
from ckpt.state import training_state
from parallel.lifetime import forks_die_with_parent


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any, meta: CheckpointMeta, thread_count: int = 1) -> Path:
    """Write `root/iter_<step>` atomically, with the checkpoint's record `meta` (saved as plain
    Python values, so it loads with `weights_only=True`)."""
    state = training_state(model, optimizer, is_loading=False, with_rng=True)
    state["scheduler"] = scheduler.state_dict()
    state["extra"] = meta.to_saved()
    return write_checkpoint(root, step, state, thread_count)


def write_checkpoint(root: str | os.PathLike, step: int, state: dict[str, Any],
                     thread_count: int = 1) -> Path:
    """Save a sharded state dict as `root/iter_<step>` (collective): temporary directory, the
    checksum manifest, fsync, rename, then the tracker."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / (checkpoint_name(step) + ".tmp")
    if dist.get_rank() == 0:
        if tmp.exists():  # left by a crashed save: never part of a complete checkpoint
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)
    _collect_results_in_process()
    try:
        with _disk_full_named(root, step):
            with _fail_if_a_child_dies(f"writing {tmp}"), _writers_stopped_on_failure(), \
                    forks_die_with_parent():
                dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy)
            dist.barrier()
            _record_checksums(tmp)
            if dist.get_rank() == 0:
                _fsync_tree(tmp)
    except KeyboardInterrupt:  # a second Ctrl-C: the partial save goes, the previous one stays
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    if dist.get_rank() == 0:
        old = root / (checkpoint_name(step) + ".old")
        if final.exists():  # re-saving a step: keep the old one until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _write_tracker(root, step)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


class DiskFullError(CheckpointError):
    """A save ran out of space; the partial save is removed, the previous checkpoint intact."""


@contextlib.contextmanager
def _disk_full_named(root: Path, step: int) -> Iterator[None]:
    """A failed write into a full disk raises `DiskFullError` saying so (megatron's and torch's
    writers report it as e.g. `unexpected pos 704 vs 598`), after removing `iter_<step>.tmp`."""
    tmp = root / (checkpoint_name(step) + ".tmp")
    try:
        yield
    except (Exception, CheckpointException) as e:  # torch's save reports a BaseException
        if not ran_out_of_space(tmp, e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        previous = f"{root / checkpoint_name(s)}" if (s := _tracked(root)) is not None else "none"
        raise DiskFullError(
            f"no space left on device (ENOSPC) while saving {tmp.name} under {root} "
            f"({failure_text(e)[:120]}): the partial save was removed; the previous "
            f"checkpoint ({previous}) is intact; free space, then resume with "
            f"checkpoint.load={root}") from e


def _tracked(root: Path) -> int | None:
    try:
        return int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def _record_checksums(tmp: Path) -> None:
    """Write `checksums.json` into the finished `tmp` (collective): each rank hashes the chunk
    files it wrote (`__<rank>_*`, still in its page cache), rank 0 everything else."""
    rank = dist.get_rank()
    mine = digests(tmp, [n for n in checkpoint_files(tmp) if n.startswith(f"__{rank}_")])
    everyone: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {name: d for rank_files in everyone for name, d in rank_files.items()}
        files |= digests(tmp, [n for n in checkpoint_files(tmp) if n not in files])
        write_manifest(tmp, files)
    dist.barrier()


def _collect_results_in_process() -> None:
    """megatron's writers report to a queue served by a multiprocessing Manager (a spawned
    server process that outlives a killed rank) so that an asynchronous save can read it from
    another process; a synchronous save puts and gets in this one, so a plain queue serves."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


@contextlib.contextmanager
def _writers_stopped_on_failure() -> Iterator[None]:
    """If the save fails or is interrupted, kill the writer processes it forked (they would go
    on writing into a directory that is about to be removed)."""
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    try:
        yield
    except BaseException:
        for child in me.children():
            with contextlib.suppress(psutil.Error):  # gone already
                if child.pid not in before and child.cmdline() == me.cmdline():  # forked
                    child.kill()
                    child.wait(5)
        raise


@contextlib.contextmanager
def _fail_if_a_child_dies(doing: str) -> Iterator[None]:
    """Raise if a child process is killed while `doing`.

    megatron's writer forks one process per file and waits on a queue for it; if that process
    is killed (OOM killer, a signal) the wait never ends. SIGCHLD interrupts the wait, and the
    handler raises. Only in the main thread (Python runs signal handlers there).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    dead_before = {pid for pid, _ in _killed_children()}

    def on_child(signum: int, frame: Any) -> None:
        for pid, sig in _killed_children():
            if pid not in dead_before:
                raise RuntimeError(f"a checkpoint writer process (pid {pid}) was killed by signal "
                                   f"{sig} while {doing}; the previous checkpoint is intact")

    previous = signal.signal(signal.SIGCHLD, on_child)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


def _killed_children() -> list[tuple[int, int]]:
    """(pid, signal) of this process's children killed by a signal and not yet reaped."""
    killed = []
    for child in psutil.Process().children():
        try:  # WNOWAIT: look, but leave the child for multiprocessing to reap
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            killed.append((child.pid, info.si_status))
    return killed


def _fsync_tree(directory: Path) -> None:
    """Flush a checkpoint's files and directory entries to disk before it is published."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(root: Path, step: int) -> None:
    tmp = root / (TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    _fsync_dir(root)
