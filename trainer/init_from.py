"""Starting a run from a checkpoint's model: the saved model config, and model-only fine-tunes.

A checkpoint carries its run config, so `checkpoint.load=DST` needs no `model=`: when the run's
model group is the untouched default, the saved model config replaces it; when the user chose a
model and it differs, the run refuses, listing the differing settings; `model.rope_*` set on
the command line (`+extrapolation=yarn`) win, as at eval (trainer/rope_override.py). A *model-only*
checkpoint (`python -m ckpt import-hf`, `reshape --model-only`) is a fine-tune start: weights
only, step 0, a fresh optimizer, schedule and data order; the tokenizer's vocabulary must fit
the checkpoint's embedding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from ckpt.inspect import MODEL_WEIGHT
from ckpt.load import load_model_weights
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from trainer.errors import UserError
from trainer.rope_override import typed_model_keys, with_rope_overrides


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


class FineTuneStart:
    """A model-only checkpoint to start from (see the module docstring)."""

    def __init__(self, path: Path, ckpt: Checkpoint) -> None:
        self.path = path
        self.rows = ckpt.tensors[MODEL_WEIGHT].shape[0]  # the padded vocabulary

    def vocab_size(self, tokenizer_vocab: int, tokenizer: str) -> int:
        """The vocabulary to build with: the checkpoint's, if the tokenizer fits in it."""
        if tokenizer_vocab > self.rows:
            raise UserError(f"data.tokenizer={tokenizer} has {tokenizer_vocab} tokens, more "
                             f"than the checkpoint {self.path} has rows ({self.rows}); use the "
                             "model's own tokenizer (data.tokenizer=HF_DIR)")
        return self.rows

    def load(self, model: torch.nn.Module) -> None:
        load_model_weights(self.path, model)


def adopt_saved_model(cfg: DictConfig) -> FineTuneStart | None:
    """Set `cfg.model` from the checkpoint `cfg.checkpoint.load` names (refusing a different
    chosen model); returns the start when the checkpoint is model-only, else None (a resume)."""
    path = resolve_checkpoint(cfg.checkpoint.load)
    ckpt = Checkpoint(path)
    if "config" not in ckpt.extra:
        return None
    # The saved model, with the run's model.rope_* (they change no parameter; a different
    # chosen model is refused, listing the differing settings): trainer/rope_override.py.
    model = with_rope_overrides(cfg.model, ckpt.config.model, typed_model_keys(_overrides()),
                                ckpt.config.trainer.seq_length, cfg.trainer.seq_length)
    with open_dict(cfg):
        cfg.model = model
    return FineTuneStart(path, ckpt) if ckpt.extra.get("model_only") else None
