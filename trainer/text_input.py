"""Reading a text file a user names on the command line: a regular file, UTF-8, bounded in size,
so `/dev/zero`, a directory or a binary file is one `error:` line rather than a hang, an
out-of-memory kill or a traceback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainer.errors import UserError

MAX_BYTES = 256 << 20  # a prompt or task file larger than this is a mistake


def read_text(path: str | os.PathLike, setting: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file `path`, named by the config key `setting`."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as err:
        raise UserError(f"{setting}={path}: cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{setting}={path}: not a regular file (a directory, device or pipe); "
                        "give a text file")
    with open(p, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UserError(f"{setting}={path}: over {max_bytes >> 20} MB; give a smaller file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{setting}={path}: not UTF-8 text (byte {err.start}); give a text "
                        "file") from None
