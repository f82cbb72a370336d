"""Writing a command's output directory all at once: a temporary directory next to DST that
replaces DST only when everything in it is written (and checked).

- The commit (DST moved aside as `.DST.old-PID`, the temporary `.DST.tmp-PID` renamed to DST,
  the old contents removed) runs with SIGINT and SIGTERM held back, so a signal either stops the
  command before it (DST as it was) or after it (DST complete): `written` records which.
- Without `--overwrite` the final rename is exclusive: a DST that appeared while the command ran
  is never replaced.
- A command killed outright (SIGKILL, a crash) leaves its `.DST.tmp-PID` / `.DST.old-PID`; the
  next command into DST removes them, or moves the old contents back when the kill came between
  the two renames, and says so; a reader of the missing DST names them (`stranded_note`).
- Running jobs' locks are honoured (`ckpt.lock`): a DST a job holds, inside one or (replaced)
  holding one is refused, when the command starts and again just before the commit.
- A DST that is a symbolic link stands for its target (decided before any work).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckpt import lock
from ckpt.disk import (
    failure_text,
    file_size_limit,
    hit_file_size_limit,
    human_bytes,
    ran_out_of_space,
    space_shortfall,
)

# Destinations this process has completely written (`python -m ckpt` reports them truthfully
# when a signal arrives after the commit).
written: list[Path] = []


def add_destination_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """DST and --overwrite, as every command that writes takes them."""
    parser.add_argument("dst", help=f"{what} (must be empty or absent)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")


class DestinationError(RuntimeError):
    """The output directory cannot be used (the message says why)."""


def check_destination(dst: Path, overwrite: bool, sources: tuple[Path, ...] = ()) -> None:
    """Refuse a non-empty `dst` (unless `overwrite`), a file, or one that is or holds a source."""
    dst = dst.resolve()
    for src in sources:
        src = src.resolve()
        if dst == src or dst in src.parents or src in dst.parents:
            raise DestinationError(f"the destination {dst} must not be, contain or lie inside the "
                             f"source {src}")
    if dst.is_file():
        raise DestinationError(f"{dst} is a file; give a directory path")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise DestinationError(f"{dst} is not empty; pass --overwrite to replace it")
    check_writable(dst)


@contextmanager
def staged(dst: Path, overwrite: bool, sources: tuple[Path, ...] = (),
           needs_bytes: int = 0) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `dst`; when the block succeeds it becomes `dst`
    (the old `dst`, if any, is removed after), when it fails it is removed and `dst` is left
    as it was. `needs_bytes`: the output's expected size, checked against the free space. A
    `dst` that is a symbolic link stands for its target."""
    dst = Path(os.path.realpath(dst)) if Path(dst).is_symlink() else Path(dst)
    clean_stale(dst)
    check_unheld(dst, overwrite)
    check_destination(dst, overwrite, sources)
    if needs_bytes and (short := space_shortfall(dst.parent, needs_bytes)):
        raise DestinationError(f"not enough space for {dst}: {short}; free space or choose "
                               "another destination")
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException as e:
        problem = _write_problem(tmp, e)
        shutil.rmtree(tmp, ignore_errors=True)
        if problem:
            raise DestinationError(f"{problem[0]} while writing {dst}: the partial output was "
                                   f"removed and {dst} is as it was; {problem[1]} "
                                   f"({failure_text(e)[:200]})") from e
        raise
    with _signals_held():
        try:
            check_unheld(dst, overwrite, meanwhile=True)
        except DestinationError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _commit(tmp, dst, overwrite)


def _write_problem(tmp: Path, e: BaseException) -> tuple[str, str] | None:
    """What stopped a write that failed with `e` and what to do, if it is the disk or the
    process's limits."""
    # here, not above: torch takes seconds to import, and a command that failed writing has it
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(e, (Exception, CheckpointException)):  # interrupted, or exiting
        return None
    if ran_out_of_space(tmp, e):
        return "no space left on device (ENOSPC)", "free space and run again"
    if hit_file_size_limit(e):
        limit = file_size_limit()
        shown = "" if limit is None else f" of {human_bytes(limit)}"
        return (f"a file reached this process's file-size limit{shown} (ulimit -f)",
                "raise it (ulimit -f unlimited), or for export-hf write smaller shards with "
                "--max-shard-bytes")
    return None


def check_unheld(dst: Path, overwrite: bool, meanwhile: bool = False) -> None:
    """Honour the locks of running jobs (`ckpt.lock`): refuse a `dst` that one holds (a run
    directory or checkpoint.dir), that lies inside one, or that would be replaced while it
    contains one. `meanwhile`: the check just before the commit."""
    found = lock.held_within(dst) if overwrite else (
        (dst.absolute(), who) if (who := lock.holder(dst)) else None)
    if found:
        where = "" if found[0] == dst.absolute() else f", inside {dst},"
        what = f"{found[0]}{where} is in use by {found[1]} (a running job's run directory or " \
               "checkpoint.dir)"
    elif above := lock.held_above(dst):
        what = f"{dst} lies inside {above[0]}, in use by {above[1]} (a running job's " \
               "directory)"
    else:
        return
    if meanwhile:
        raise DestinationError(f"{what}: a job took it while this command ran, so this output "
                               f"was discarded and {dst} is as it was; choose another DST, or "
                               "wait for that job to end and run again")
    raise DestinationError(f"{what}: choose another DST, or wait for that job to end")


def _commit(tmp: Path, dst: Path, overwrite: bool) -> None:
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if overwrite and (dst.exists() or dst.is_symlink()):
        os.replace(dst, old)
        try:
            os.replace(tmp, dst)
        except OSError:
            os.replace(old, dst)  # DST as it was; the caller's error says why
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        written.append(dst)
        _remove(old)
        return
    with contextlib.suppress(OSError):
        dst.rmdir()  # an empty DST may be replaced; a non-empty one stays and fails below
    try:
        _rename_exclusive(tmp, dst)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise DestinationError(f"{dst} appeared while this command ran (another command writing "
                               "it?) and was left as it is; pass --overwrite to replace it"
                               ) from None
    written.append(dst)


def _rename_exclusive(src: Path, dst: Path) -> None:
    """rename(2) that fails with EEXIST instead of replacing `dst` (Linux renameat2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):
        at_fdcwd, rename_noreplace = -100, 1
        if libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst),
                          rename_noreplace) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):  # else: not supported by this file system
            raise OSError(code, os.strerror(code), str(dst))
    if dst.exists() or dst.is_symlink():
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive in the block are delivered at its end (main thread only:
    Python runs signal handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        pending.append(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def clean_stale(dst: Path) -> None:
    """Remove the `.DST.tmp-PID` / `.DST.old-PID` of killed commands (naming them), moving the
    old contents back into DST when the kill came between the commit's two renames."""
    if not dst.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.(tmp|old)-(\d+)")
    for path in sorted(dst.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if not match or int(match[2]) == os.getpid():
            continue
        if _alive(int(match[2])):
            print(f"warning: {path} belongs to pid {match[2]}, still running: left as it is",
                  file=sys.stderr)
        elif match[1] == "old" and not (dst.exists() or dst.is_symlink()):
            os.rename(path, dst)
            print(f"warning: moved {path} back to {dst}: a command (pid {match[2]}) was killed "
                  f"while replacing it", file=sys.stderr)
        else:
            _remove(path)
            print(f"warning: removed {path}, left by a killed command (pid {match[2]})",
                  file=sys.stderr)


def stranded_note(path: Path) -> str:
    """For a missing `path`: where its old contents are, when a command was killed between its
    commit's two renames (`.NAME.old-PID` beside it or beside a missing parent); else ''."""
    path = Path(path).absolute()
    for missing in [path, *path.parents]:
        if missing.exists() or missing.is_symlink():
            return ""
        if not missing.parent.is_dir():
            continue
        pattern = re.compile(rf"\.{re.escape(missing.name)}\.old-(\d+)")
        for old in sorted(missing.parent.iterdir()):
            if (match := pattern.fullmatch(old.name)) and not _alive(int(match[1])):
                return (f"; {missing} is missing, but {old} holds its old contents: a command "
                        f"(pid {match[1]}) was killed while replacing it; `mv {old} {missing}` "
                        f"restores it (so does the next python -m ckpt command into {missing})")
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_writable(dst: Path) -> None:
    """The nearest existing folder above `dst` (resolved) must be a directory this process may
    write in: a DST under a file or on a read-only file system is refused before any work."""
    above = dst.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise DestinationError(f"{dst} lies under the file {above}; choose a DST whose parents "
                               "are directories")
    if not os.access(above, os.W_OK):
        raise DestinationError(f"{above} is not writable (read-only file system or no "
                               f"permission), so {dst} cannot be written; choose another DST")
