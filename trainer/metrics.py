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
        if self.path.exists():
            self._set_aside_rows_after(start_step)
        if wandb_cfg is not None and wandb_cfg.wandb:
            self.wandb_run = start_wandb(run_dir, wandb_cfg, config or {}, wandb_id)

    def _set_aside_rows_after(self, start_step: int) -> None:
        """Keep one row per step: rows past `start_step` (a fresh run: every row; a resume: the
        steps it repeats) move to `metrics.<unix time>.jsonl`, so nothing is lost."""
        kept, aside = [], []
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # e.g. a line cut short by a kill
                step = None
            (kept if step is not None and step <= start_step else aside).append(line)
        if not aside:
            return
        old = self.path.with_name(f"metrics.{int(time.time())}.jsonl")
        old.write_text("".join(aside))
        tmp = self.path.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        log.warning("metrics.jsonl held %d rows after step %d: moved them to %s", len(aside),
                    start_step, old.name)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            # labels (the attention kernel) are in the run's config; the history holds numbers
            self.wandb_run.log({k: v for k, v in row.items()
                                if k != "step" and not isinstance(v, str)}, step=row["step"])

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
