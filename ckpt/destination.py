"""Writing a command's output directory all at once: a temporary directory next to DST that
replaces DST only when everything in it is written (and checked).

- The commit (DST moved aside as `.DST.old-PID`, the temporary `.DST.tmp-PID` renamed to DST,
  the old contents removed) runs with SIGINT and SIGTERM held back, so a signal either stops the
  command before it (DST as it was) or after it (DST complete): `written` records which.
- Without `--overwrite` the final rename is exclusive: a DST that appeared while the command ran
  is never replaced.
- A command killed outright (SIGKILL, a crash) leaves its `.DST.tmp-PID` / `.DST.old-PID`; the
  next command into DST removes them, or moves the old contents back when the kill came between
  the two renames, and says so.
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

from ckpt.disk import ran_out_of_space, space_shortfall

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
    as it was. `needs_bytes`: the output's expected size, checked against the free space."""
    clean_stale(dst)
    check_destination(dst, overwrite, sources)
    if needs_bytes and (short := space_shortfall(dst.parent, needs_bytes)):
        raise DestinationError(f"not enough space for {dst}: {short}; free space or choose "
                               "another destination")
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except Exception as e:
        full = ran_out_of_space(tmp, e)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DestinationError(f"no space left on device (ENOSPC) while writing {dst}: the "
                                   f"partial output was removed and {dst} is as it was; free "
                                   f"space and run again ({' '.join(str(e).split())[:200]})"
                                   ) from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _signals_held():
        _commit(tmp, dst, overwrite)


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
