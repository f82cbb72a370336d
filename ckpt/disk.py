"""Free space: checked before a write whose size is known, and named when a write runs out of it
(megatron's and torch's writers report a full disk as e.g. `unexpected pos 704 vs 598`); the
same for the file-size limit (`ulimit -f`: EFBIG, `File too large`)."""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path

# Below this, a write that failed is taken to have failed for want of space.
LOW_WATER_BYTES = 16 * 2**20


def human_bytes(n: float) -> str:
    """`n` bytes in decimal units, as messages and tables show sizes ("1.5 GB")."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged write may still use on the file system that holds `path` (or would
    hold it: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, its causes and contexts, and the failures torch's `CheckpointException` (a
    BaseException whose message is a traceback) carries per rank."""
    pending, seen = [err], set()
    while pending:
        e = pending.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        pending += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)


def failure_text(err: BaseException) -> str:
    """`err`'s message on one line (for torch's `CheckpointException`: the first failure's)."""
    for e in _chain(err):
        if not getattr(e, "failures", None):
            return " ".join(f"{type(e).__name__}: {e}".split())
    return " ".join(str(err).split())


def ran_out_of_space(path: Path, err: BaseException) -> bool:
    """Whether `err`, raised while writing under `path`, comes from a full disk (or quota)."""
    for seen in _chain(err):
        if getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT) \
                or "No space left on device" in str(seen):
            return True
    try:
        return free_bytes(path) < LOW_WATER_BYTES
    except OSError:
        return False


def hit_file_size_limit(err: BaseException) -> bool:
    """Whether `err` comes from the process's file-size limit (`ulimit -f`, EFBIG)."""
    return any(getattr(e, "errno", None) == errno.EFBIG or "File too large" in str(e)
               for e in _chain(err))


def file_size_limit() -> int | None:
    """The process's file-size limit in bytes (`ulimit -f`), or None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def space_shortfall(path: Path, needed: int) -> str | None:
    """Why `needed` bytes will not fit under `path`, or None."""
    free = free_bytes(path)
    if free >= needed:
        return None
    return (f"{path}'s file system has {human_bytes(free)} free, and this needs about "
            f"{human_bytes(needed)}")
