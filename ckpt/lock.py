"""The one lock protocol of every writer of a run directory or a checkpoints root.

A directory D is *held* while a process holds an exclusive `flock` on `D/run.lock` (the file
names its pid and host). The OS releases it on any exit, SIGKILL included, so a lock is never
stale, and taking it is atomic, so two writers never both get one directory.

- `python -m trainer` (rank 0) holds its run directory and its `checkpoint.dir`, wherever the
  two lie; `python -m trainer.eval` holds its run directory.
- A training run refuses a `checkpoint.dir` held by another process or lying inside a directory
  another process holds (`trainer.run_dir`).
- A `python -m ckpt` command refuses a DST that another process holds, that lies inside one
  or, when it would replace DST (`--overwrite`), that contains one; it checks when it starts
  and again just before its output replaces DST (`ckpt.destination`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK = "run.lock"
_held: dict[Path, int] = {}  # directory -> its open lock file, kept for the process's life


class InUse(RuntimeError):
    """`directory` is held by another process (`holder`: `pid N on HOST`)."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(f"{directory} is in use by {holder}")
        self.directory, self.holder = directory, holder


def hold(directory: Path) -> None:
    """Take `directory`'s lock for the rest of this process (creating the directory), or raise
    `InUse` naming its holder. OSError: the directory cannot be created or written."""
    directory = Path(directory).absolute()
    if directory.resolve() in _held:
        return
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        raise InUse(directory, _named_holder(directory)) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    except OSError:
        os.close(fd)  # releases the lock: a full disk, say; the caller reports it
        raise
    _held[directory.resolve()] = fd  # by its real path: one lock however a path spells it


def holder(directory: Path) -> str | None:
    """Who holds `directory` (`pid N on HOST`), or None: free, or held by this process."""
    directory = Path(directory).absolute()
    if directory.resolve() in _held:
        return None
    try:
        fd = os.open(directory / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return _named_holder(directory)
        return None
    finally:
        os.close(fd)  # closing releases a lock taken here
    return None


def _named_holder(directory: Path) -> str:
    try:
        with open(directory / LOCK, "rb") as f:
            text = f.read(200).decode(errors="replace").strip().splitlines()
    except OSError:
        text = []
    return text[0] if text else "another process"


def held_above(path: Path) -> tuple[Path, str] | None:
    """The nearest directory above `path` that another process holds, and its holder."""
    for parent in Path(path).absolute().parents:
        if who := holder(parent):
            return parent, who
    return None


def held_within(path: Path) -> tuple[Path, str] | None:
    """`path` itself or a directory under it that another process holds, and its holder."""
    path = Path(path).absolute()
    if who := holder(path):
        return path, who
    if not path.is_dir() or path.is_symlink():
        return None
    for lock in sorted(path.rglob(LOCK)):  # symbolic links to directories are not followed
        if who := holder(lock.parent):
            return lock.parent, who
    return None
