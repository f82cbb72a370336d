"""Where checkpoints live under a checkpoints root, and which one a path means.

    iter_0000020/                     one complete checkpoint per save
    latest_checkpointed_iteration.txt the newest *complete* step, replaced atomically
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckpt.destination import stranded_note

TRACKER = "latest_checkpointed_iteration.txt"

# Help text of every command's checkpoint argument (what `resolve_checkpoint` accepts).
CHECKPOINT_HELP = "a checkpoints root (its latest checkpoint) or an iter_* directory"


class CheckpointError(RuntimeError):
    """A damaged, incomplete, unsafe or incompatible checkpoint; the message names the file."""


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoints root (its latest complete checkpoint) or one `iter_*` directory."""
    path = Path(path)
    if (path / TRACKER).is_file():
        step = _tracked_step(path / TRACKER)
        ckpt = path / checkpoint_name(step)
        if not (ckpt / "metadata.json").is_file():
            raise FileNotFoundError(f"{path / TRACKER} names step {step}, but {ckpt} is missing "
                                    "or incomplete")
        return ckpt
    if re.fullmatch(r"iter_\d+", path.name) and (path / "metadata.json").is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory{stranded_note(path)}")
    raise FileNotFoundError(
        f"{path} is neither a checkpoints root (no {TRACKER}) nor a complete iter_* checkpoint"
    )


def _tracked_step(tracker: Path) -> int:
    """The step a tracker file names; a damaged tracker is named with its content."""
    with open(tracker, "rb") as f:  # a few bytes: it may be a link to anything (/dev/zero)
        text = f.read(64).decode(errors="replace").strip()
    if not re.fullmatch(r"\d+", text):
        shown = ("(a symbolic link: its target is not shown)" if tracker.is_symlink()
                 else repr(text[:40]))
        raise CheckpointError(
            f"{tracker} should hold a step number but holds {shown}; load one iter_* "
            "directory instead, or write the step of the newest complete one into the file")
    return int(text)
