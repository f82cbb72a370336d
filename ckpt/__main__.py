"""`python -m ckpt COMMAND ...`: inspect, verify, reshape, export and import checkpoints."""

from __future__ import annotations

import argparse
import sys

from ckpt import (
    destination,
    gguf,
    hf_export,
    hf_import,
    inspect,
    reshape,
    verify,
    zarr_export,
)
from ckpt.destination import DestinationError
from ckpt.hf_config import HFError
from ckpt.reader import CheckpointError
from parallel.lifetime import Interrupted, interruptible

# Errors that are the user's input or the checkpoint, not a bug: one line, no traceback.
USER_ERRORS = (CheckpointError, reshape.ReshapeError, zarr_export.ExportError, DestinationError,
               FileNotFoundError, HFError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ckpt",
        description="Inspect, verify, reshape (TP a -> b), export to zarr and import megatron "
                    "torch_dist training checkpoints. SRC/DIR may be a checkpoints root (its "
                    "latest complete checkpoint is used) or one iter_* directory.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (inspect, verify, reshape, zarr_export, hf_import, hf_export, gguf):
        module.add_parser(commands)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    destination.written.clear()
    try:
        with interruptible():  # SIGTERM unwinds too: workers stopped, partial output removed
            return args.run(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        done = ", ".join(str(p) for p in destination.written)
        print(f"error: {e}; " + (f"after {done} was completely written" if done
                                 else "nothing was written"), file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
