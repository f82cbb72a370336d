"""Writing a command's output directory all at once: a temporary directory next to DST that
replaces DST only when everything in it is written (and checked)."""

from __future__ import annotations

import argparse
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


@contextmanager
def staged(dst: Path, overwrite: bool, sources: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `dst`; when the block succeeds it becomes `dst`
    (the old `dst`, if any, is removed after), when it fails it is removed and `dst` is left
    as it was."""
    check_destination(dst, overwrite, sources)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
