"""Free space: checked before a write whose size is known, and named when a write runs out of it
(megatron's and torch's writers report a full disk as e.g. `unexpected pos 704 vs 598`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ckpt.inspect import human_bytes

# Below this, a write that failed is taken to have failed for want of space.
LOW_WATER_BYTES = 16 * 2**20


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged write may still use on the file system that holds `path` (or would
    hold it: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ran_out_of_space(path: Path, err: BaseException) -> bool:
    """Whether `err`, raised while writing under `path`, comes from a full disk (or quota)."""
    seen: BaseException | None = err
    while seen is not None:
        if getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT) \
                or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return free_bytes(path) < LOW_WATER_BYTES
    except OSError:
        return False


def space_shortfall(path: Path, needed: int) -> str | None:
    """Why `needed` bytes will not fit under `path`, or None."""
    free = free_bytes(path)
    if free >= needed:
        return None
    return (f"{path}'s file system has {human_bytes(free)} free, and this needs about "
            f"{human_bytes(needed)}")
