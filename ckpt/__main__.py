"""`python -m ckpt COMMAND ...`: inspect, verify, reshape, export and import checkpoints.

The command line and the checks of its input load nothing heavy (`ckpt.commands`): torch,
megatron and the command's own module are imported once those have passed, so help and bad
input answer in a fraction of a second instead of after seconds of imports.
"""

from __future__ import annotations

import argparse
import sys

from ckpt import destination
from ckpt.commands import add_commands
from ckpt.destination import DestinationError
from ckpt.errors import ExportError, ReshapeError
from ckpt.hf_config import HFError
from ckpt.paths import CheckpointError

# Errors that are the user's input or the checkpoint, not a bug: one line, no traceback.
USER_ERRORS = (CheckpointError, ReshapeError, ExportError, DestinationError, FileNotFoundError,
               HFError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ckpt",
        description="Inspect, verify, reshape (TP a -> b), export to zarr and import megatron "
                    "torch_dist training checkpoints. SRC/DIR may be a checkpoints root (its "
                    "latest complete checkpoint is used) or one iter_* directory.")
    add_commands(p.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    destination.written.clear()
    try:
        args.check(args)
        return run(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """The command, once its input has passed `check`; an interruption is reported with what
    was completely written."""
    from parallel.lifetime import Interrupted, interruptible  # torch: only for a command that runs

    try:
        with interruptible():  # SIGTERM unwinds too: workers stopped, partial output removed
            return args.run(args)
    except Interrupted as e:
        done = ", ".join(str(p) for p in destination.written)
        print(f"error: {e}; " + (f"after {done} was completely written" if done
                                 else "nothing was written"), file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
