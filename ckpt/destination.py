"""Writing a command's output directory all at once: a temporary directory next to DST that
replaces DST only when everything in it is written (and checked)."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
def staged(dst: Path, overwrite: bool, sources: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `dst`; when the block succeeds it becomes `dst`
    (with `overwrite` the old `dst`, if any, is removed after; without, only an empty or absent
    `dst` is replaced), when it fails it is removed and `dst` is left as it was."""
    check_destination(dst, overwrite, sources)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not overwrite:
        claim(tmp, dst)
        return
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


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


def claim(tmp: Path, dst: Path) -> None:
    """Rename the finished `tmp` to `dst` without replacing anything but an empty directory:
    rename(2) refuses a non-empty one, so a second command that wrote the same new DST
    meanwhile is never replaced silently (without --overwrite)."""
    try:
        os.rename(tmp, dst)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise DestinationError(f"{dst} was written by another command while this one ran; "
                               "it is kept and this output discarded: pass --overwrite to "
                               "replace it, or choose another DST") from None
