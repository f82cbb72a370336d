"""`python -m trainer [overrides]`: one Hydra run (also under `torchrun --nproc-per-node N`).

Under torchrun, ranks first agree on one run directory (rank 0's stamp); only rank 0 writes
`.hydra/`, the job log, metrics and wandb; the other ranks create no directories. Rank 0 locks
the run directory before Hydra writes into it (`trainer.run_dir`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from parallel.placement import resolve_device
from parallel.process_group import join_process_group
from trainer.config import CONF_DIR, register_configs
from trainer.entry import (
    arrange_argv,
    check_early,
    check_overrides,
    exits_on_user_error,
    report_user_error,
)
from trainer.errors import UserError

register_configs()
# Long-context steps allocate a few huge activation blocks; expandable segments keep the caching
# allocator from fragmenting them (bench/train.py sets the same).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _device_override(argv: list[str]) -> str:
    for arg in argv:
        if arg.startswith("trainer.device="):
            return arg.split("=", 1)[1]
    return "auto"


def _run_stamp() -> str:
    """`<date>/<time>-<pid>`: jobs started in the same second get different run directories."""
    return f"{time.strftime('%Y-%m-%d/%H-%M-%S')}-{os.getpid()}"


def _agree_on_run_dir() -> None:
    """Join the process group early and give every rank rank 0's run-directory stamp; silence
    Hydra's outputs on the other ranks."""
    join_process_group(resolve_device(_device_override(sys.argv[1:])))
    stamp = [_run_stamp()]
    dist.broadcast_object_list(stamp, src=0)
    os.environ["LONGCTX_RUN_STAMP"] = stamp[0]
    if dist.get_rank() != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout",
                     "hydra.job_logging.root.level=WARNING"]


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@exits_on_user_error
def run(cfg: DictConfig) -> None:
    from trainer.run_dir import checkpoints_root, raise_refusal

    raise_refusal()  # the run directory is held by another run or holds checkpoints
    from trainer.stop import Stopped
    from trainer.train import train  # heavy imports once the config and directory are fine

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    resume = (f"its last complete checkpoint, if any, resumes with "
              f"checkpoint.load={checkpoints_root(cfg, run_dir)}")
    try:
        train(cfg, run_dir)
    except Stopped as stopped:  # saved; 128 + signal, as if the signal had ended the process
        sys.exit(stopped.exit_status)
    except KeyboardInterrupt:  # Ctrl-C during setup, or a second one while stopping
        report_user_error(UserError(f"interrupted by SIGINT (nothing saved since the last "
                                    f"checkpoint); {resume}"))
        sys.exit(128 + signal.SIGINT)
    except OSError as e:  # the run directory's disk filled up, or turned read-only
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        raise UserError(f"{e.strerror} while writing {e.filename or 'the run outputs'}: free "
                        f"space (or make it writable), then resume: {resume}") from e


def _validate(cfg: DictConfig, argv: list[str]) -> None:
    from trainer.config import check_known_keys
    from trainer.init_from import check_load_exists
    from trainer.validate import validate_train

    check_known_keys(cfg)
    if cfg.checkpoint.load:  # before validate_train, which imports megatron for the model check
        check_load_exists(cfg.checkpoint.load)
    validate_train(cfg, int(os.environ.get("WORLD_SIZE", "1")), overrides=argv)


def main() -> None:
    argv = sys.argv[1:]
    cfg = check_overrides(argv)
    if cfg is not None:  # the settings' errors before the process group and megatron's imports
        check_early(lambda: _validate(cfg, argv))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _agree_on_run_dir()
    else:
        os.environ["LONGCTX_RUN_STAMP"] = _run_stamp()
    # Hydra's flags first, the overrides together after them (`--cfg job` anywhere)
    sys.argv[1:] = arrange_argv(sys.argv[1:], (
        "+hydra.callbacks.claim_run_dir._target_=trainer.run_dir.ClaimRunDir",))
    run()


if __name__ == "__main__":
    main()
