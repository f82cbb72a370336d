"""Run outputs on rank 0: `metrics.jsonl`, console lines and wandb."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLogger:
    """Writes one JSON object per logged step to `metrics.jsonl` and mirrors it to wandb.

    Only the main rank constructs an active logger; others get `enabled=False` and write nothing.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int = 0, wandb_cfg: Any = None,
                 config: dict | None = None, wandb_id: str | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        if not enabled:
            return
        if start_step == 0 and self.path.exists():
            # A fresh run in a reused run directory: keep the old rows, but not in our file.
            old = self.path.with_name(f"metrics.{int(time.time())}.jsonl")
            self.path.rename(old)
            log.warning("run directory already had metrics.jsonl: moved it to %s", old.name)
        if wandb_cfg is not None and wandb_cfg.wandb:
            self.wandb_run = start_wandb(run_dir, wandb_cfg, config or {}, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def finish(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def start_wandb(run_dir: Path, cfg: Any, config: dict, run_id: str | None,
                **overrides: Any) -> Any:
    """Offline unless WANDB_MODE or `logger.mode` says otherwise; resumes `run_id` if given.
    `overrides` (group, name, job_type...) replace the logger config's values."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or cfg.mode
    settings = dict(project=cfg.project, entity=cfg.entity, group=cfg.group, name=cfg.name,
                    tags=list(cfg.tags))
    run = wandb.init(**(settings | overrides), config=config, dir=str(run_dir), mode=mode,
                     id=run_id, resume="allow" if run_id else None)
    log.info("wandb run %s (%s mode) in %s", run.id, mode, run_dir / "wandb")
    return run
