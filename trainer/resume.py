"""What a resumed run does with settings that differ from its checkpoint's saved config.

megatron's choice per key (`--override-opt_param-scheduler`), decided before anything is built:
- `trainer.max_steps` takes effect (the decay schedule ends at the new value); below the
  checkpoint's step it is refused.
- the schedule and optimizer hyper-parameters (`SCHEDULE`) are refused unless
  `checkpoint.override_scheduler=true`, which applies the new values from the resumed step on.
- `data.tokenizer` naming another tokenizer file is refused: the embeddings belong to the saved
  one.
- settings that change what the steps see (`WARNED`) take effect with one warning each.
"""

from __future__ import annotations

import filecmp
import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ckpt.meta import CheckpointMeta
from ckpt.reader import Checkpoint
from ckpt.saved_config import SavedConfigError, read_saved_config, unresolved_env
from trainer.errors import UserError

log = logging.getLogger(__name__)

SCHEDULE = ("trainer.lr", "trainer.min_lr", "trainer.warmup_steps", "trainer.lr_decay_style",
            "trainer.weight_decay", "trainer.adam_beta1", "trainer.adam_beta2")
# Keys, or groups ending in ".", whose change keeps the saved state usable but changes the run.
WARNED = ("trainer.global_batch_size", "trainer.seq_length", "trainer.seed", "trainer.precision",
          "data.", "attention.", "model.rope_theta", "model.layernorm_epsilon")


class ResumeSettingsError(UserError):
    """The resumed run's settings contradict its checkpoint."""


def check_resume(cfg: DictConfig, ckpt: Checkpoint) -> None:
    """Refuse, or warn about, the settings of `cfg` that differ from the run config the
    checkpoint was trained with (a model-only checkpoint has none: it starts a fine-tune)."""
    meta = ckpt.meta
    if meta.run_config is not None and not meta.model_only:
        for warning in check_settings(saved_run_config(meta), cfg, meta.step, str(ckpt.path)):
            log.warning(warning)


def saved_run_config(meta: CheckpointMeta) -> DictConfig:
    """The run config a checkpoint was trained with (its record carries it verbatim), read as
    data: no interpolation, bounded (`ckpt.saved_config`)."""
    try:
        return read_saved_config(meta.run_config)
    except SavedConfigError as e:
        raise UserError(f"the checkpoint's saved run config: {e}") from None


def check_settings(saved: DictConfig, cfg: DictConfig, step: int, where: str) -> list[str]:
    """Raise `ResumeSettingsError` for a change the resume cannot honour; return one warning
    per change it honours with consequences."""
    if cfg.trainer.max_steps < step:
        raise ResumeSettingsError(
            f"trainer.max_steps={cfg.trainer.max_steps} is below the step of {where} ({step}): "
            f"set trainer.max_steps >= {step}")
    # the saved config's strings are literal (ckpt.saved_config); this run's as it will save
    # them: an environment interpolation's text, never its value (it would be logged)
    old, new = _flat(OmegaConf.to_container(saved, resolve=True)), _flat(unresolved_env(cfg))
    changed = {k: (old[k], new[k]) for k in new if k in old and old[k] != new[k]}
    schedule = [f"{k} {a} -> {b}" for k, (a, b) in changed.items() if k in SCHEDULE]
    if schedule and not cfg.checkpoint.override_scheduler:
        raise ResumeSettingsError(
            f"{', '.join(schedule)} differ from {where}: set checkpoint.override_scheduler=true "
            "to apply the new values from this step on, or set them back")
    warnings = []
    if "data.tokenizer" in changed:
        a, b = changed.pop("data.tokenizer")
        if not (os.path.isfile(a) and os.path.isfile(b)):
            if "byte" in (a, b) or os.path.isfile(a):
                raise ResumeSettingsError(
                    f"data.tokenizer {b!r} is not the tokenizer of {where} ({a!r}), whose "
                    f"embeddings belong to it: set data.tokenizer={a}")
            warnings.append(f"resuming {where} with data.tokenizer={b}: its saved tokenizer {a} "
                            "is gone, so it cannot be compared")
        elif not filecmp.cmp(a, b, shallow=False):
            raise ResumeSettingsError(
                f"data.tokenizer {b} differs from {a}, the tokenizer of {where}, whose "
                f"embeddings belong to it: set data.tokenizer={a}")
    return warnings + [f"resuming {where} with {k}={b} (saved: {a}): {_consequence(k)}"
                       for k, (a, b) in changed.items()
                       if any(k == w or (w.endswith(".") and k.startswith(w)) for w in WARNED)]


def _consequence(key: str) -> str:
    if key.startswith("data.") or key in ("trainer.seq_length", "trainer.seed"):
        return "the data order differs from the saved run's (samples may repeat or be skipped)"
    if key == "trainer.global_batch_size":
        return "the data position carries over in samples; steps now hold a different batch"
    return "the saved weights continue under the new setting"


def _flat(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = node

    walk(values, "")
    return out


def apply_optimizer_settings(optimizer: Any, scheduler: Any, cfg: DictConfig) -> None:
    """The configured peak and floor lr and Adam betas, after a load: megatron keeps them in
    each param group, so loading an optimizer state restores the saved ones (`check_settings`
    let them differ only with `checkpoint.override_scheduler`); then the lr of this step."""
    t = cfg.trainer
    for group in optimizer.param_groups:
        group.update(max_lr=t.lr, min_lr=t.min_lr, betas=(t.adam_beta1, t.adam_beta2))
    scheduler.step(increment=0)


def check_finished(cfg: DictConfig, source: Checkpoint) -> None:
    """A resume from a run's last step trains nothing: say so, and how to train on (a
    max_steps below the step is `check_resume`'s refusal)."""
    step, last = source.meta.step, cfg.trainer.max_steps
    if step == last:
        raise UserError(f"checkpoint.load={cfg.checkpoint.load} is at step {step} and "
                        f"trainer.max_steps is {last}: that run is finished. To train on from "
                        f"it, raise trainer.max_steps (e.g. trainer.max_steps={step + last}); "
                        "the schedule then decays over the longer run")
