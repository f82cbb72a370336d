"""How the entry points (`python -m trainer`, `trainer.eval`, `trainer.build_data`) end on a
user error: `error: <message>` on stderr (rank 0 only under torchrun) and exit status 2 on every
rank, like `python -m ckpt`; anything else is a bug and keeps its traceback.

`HYDRA_FULL_ERROR=1` or `LONGCTX_DEBUG=1` shows the user error's traceback too.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from omegaconf import DictConfig

from ckpt.reader import CheckpointError
from models.errors import AttentionTooLarge
from parallel.placement import PlacementError
from trainer.errors import UserError

# What counts as the user's mistake. Plain ValueError does not: library code raises it for bugs
# too, so the trainer's own checks (trainer/validate.py) raise UserError, and the model config's
# ValueErrors are turned into UserError there, before the model is built. FileNotFoundError is
# a path the user named (checkpoint.load, data.path, build_data's inputs); CheckpointError a
# damaged or incompatible checkpoint (the same classification as `python -m ckpt`);
# PlacementError a device, precision or layout that cannot be used (`parallel.placement`);
# AttentionTooLarge an attention call past its path's memory bound (lengths the user chose).
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, CheckpointError, FileNotFoundError,
                                                PlacementError, AttentionTooLarge)

T = TypeVar("T")
EARLY_EXIT_GRACE_S = 5.0  # how long the other ranks let rank 0 report an early error


def debug_requested() -> bool:
    """True when the user asked for tracebacks of user errors as well."""
    return any(os.environ.get(name, "") not in ("", "0")
               for name in ("HYDRA_FULL_ERROR", "LONGCTX_DEBUG"))


def report_user_error(err: BaseException) -> None:
    """Print `error: <message>` once (rank 0 of a torchrun job, or the single process); under
    torchrun also hand it to torchrun's error file, so that its failure report names it as the
    root cause instead of "To enable traceback see: ..."."""
    if os.environ.get("RANK", "0") == "0":
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            with open(error_file, "w") as f:  # torch.distributed.elastic's reply-file format
                json.dump({"message": f"error: {message}", "timestamp": str(int(time.time()))},
                          f)


def check_overrides(argv: list[str], config_name: str = "config") -> DictConfig | None:
    """Compose the config from the command line's overrides before Hydra runs the job, so that a
    misspelt key, a wrong type or an unknown config group ends as one `error:` line with exit
    status 2 instead of Hydra's multi-line report with status 1: a value outside a choice is
    `<setting>=<value> must be one of a, b, c`, a setting typed under its old name names the new
    one (`trainer.config.check_moved`). Command lines with Hydra flags (`-m`, `--help`, `--cfg`,
    ...) go to Hydra unchecked. Returns the composed config (None when unchecked)."""
    if any(arg.startswith("-") for arg in argv) or debug_requested():
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from trainer.config import CONF_DIR, MOVED, check_moved, moved_message

    try:
        check_moved(argv)
    except UserError as err:
        report_user_error(err)
        sys.exit(2)
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name, overrides=argv)
    except (HydraException, OmegaConfBaseException) as err:
        message = _hydra_message(err)
        moved = _OLD_ATTENTION_KEY.search(message)  # an old name in a config file of one's own
        if moved and f"attention.{moved['key']}" in MOVED:
            message = moved_message(f"attention.{moved['key']}")
        else:
            message = choice_message(err) or (f"{message} (python -m trainer --help lists the "
                                              "config groups)")
        report_user_error(UserError(message))
        sys.exit(2)


_OLD_ATTENTION_KEY = re.compile(r"Key '(?P<key>\w+)' not in 'AttentionConfig'")
# omegaconf's message for a value outside an Enum field's members
_INVALID_CHOICE = re.compile(r"Invalid value '(?P<value>.*)', expected one of \[(?P<valid>.*)\]")


def choice_message(err: BaseException | None) -> str | None:
    """`<setting>=<value> must be one of a, b, c` when `err` (or an error it comes from) is
    omegaconf refusing a value outside a choice (an Enum field), else None."""
    while err is not None:
        match = _INVALID_CHOICE.search(str(err).splitlines()[0] if str(err) else "")
        key = getattr(err, "full_key", None)
        if match and key:
            return f"{key}={match['value']!r} must be one of {match['valid']}"
        err = err.__cause__
    return None


# Hydra's command-line flags that take a value (`--cfg job`); the others take none
_VALUED_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name",
                 "-cn", "--config-dir", "-cd", "--experimental-rerun", "--shell-completion",
                 "-sc"}
_OPTIONAL_VALUE_FLAGS = {"--info", "-i"}  # `--info` alone or `--info defaults`
_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def arrange_argv(argv: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """The command line with Hydra's flags first and every override (the user's, then `extra`)
    after them, so flags go anywhere on the line (Hydra's parser takes overrides as one group);
    `--cfg` shows resolved values (`--resolve`), as the run uses them."""
    flags, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _VALUED_FLAGS and i + 1 < len(argv):
            flags += argv[i:i + 2]
            i += 2
            continue
        if arg in _OPTIONAL_VALUE_FLAGS and i + 1 < len(argv) and argv[i + 1] in _INFO_VALUES:
            flags += argv[i:i + 2]
            i += 2
            continue
        (flags if arg.startswith("-") else overrides).append(arg)
        i += 1
    if any(f in ("--cfg", "-c") for f in flags) and "--resolve" not in flags:
        flags.append("--resolve")
    return flags + overrides + list(extra)


def check_early(check: Callable[[], object]) -> None:
    """Run `check` before the process group and the heavy imports: a user error ends the process
    as `exits_on_user_error` does, seconds after start (every rank of a torchrun job reaches the
    same verdict from the same command line; only rank 0 prints it)."""
    if debug_requested():
        return
    try:
        check()
    except USER_ERRORS as err:
        report_user_error(err)
        if os.environ.get("RANK", "0") != "0":
            # torchrun stops the job at the first rank to exit: let rank 0 print and leave
            # first (no process group yet to meet in, as `_leave_process_group` does)
            time.sleep(EARLY_EXIT_GRACE_S)
        sys.exit(2)


def _hydra_message(err: BaseException) -> str:
    """Hydra's and omegaconf's message and its causes on one line, without omegaconf's node
    bookkeeping (full_key, reference_type, ...) and Hydra's search path."""
    parts: list[str] = []
    while err is not None:
        for line in str(err).splitlines():
            line = line.strip()
            if line.startswith("Config search path"):
                break
            if line and not line.startswith(("full_key:", "reference_type=", "object_type=",
                                              "provider=")) and line not in parts:
                parts.append(line)
        err = err.__cause__
    return " ".join(parts)


def exits_on_user_error(func: Callable[..., T]) -> Callable[..., T]:
    """Wrap an entry point (inside `@hydra.main`, so Hydra never sees the error): a user error
    prints one line and exits with status 2; SystemExit passes through Hydra's error reporting."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs) -> T:
        try:
            return func(*args, **kwargs)
        except USER_ERRORS as err:
            if debug_requested():
                raise
            report_user_error(err)
            _leave_process_group()
            sys.exit(2)

    return wrapper


def _leave_process_group(wait_s: float = 10.0) -> None:
    """Meet the other ranks (rank 0 has printed by then) and destroy the process group, so that
    torchrun, which stops the job at the first rank to exit, does not cut rank 0 short. A rank
    that raised alone does not wait for ever: the barrier runs in a daemon thread."""
    import threading

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        met = threading.Event()

        def barrier() -> None:
            dist.barrier()
            met.set()

        threading.Thread(target=barrier, daemon=True).start()
        if not met.wait(wait_s):
            return
    dist.destroy_process_group()
