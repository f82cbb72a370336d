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
from ckpt.load import load_fine_tune_start
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from trainer.errors import UserError
from trainer.rope_override import typed_model_keys, with_rope_overrides


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def real_vocab(ckpt: Checkpoint) -> int:
    """The model's vocabulary without padding: an imported model's `vocab_size`, the one a
    trainer run recorded (`extra.vocab_size`), else the embedding rows."""
    return ((ckpt.extra.get("hf_source") or {}).get("vocab_size") or ckpt.extra.get("vocab_size")
            or ckpt.tensors[MODEL_WEIGHT].shape[0])


def checkpoint_vocab(path: Path, ckpt: Checkpoint, tokenizer_vocab: int, tokenizer: str) -> int:
    """The vocabulary to build the checkpoint's model with: its embedding rows (the padded
    vocabulary), if the tokenizer's ids fit the model's real vocabulary (`real_vocab`); refused
    naming both sizes otherwise."""
    rows = ckpt.tensors[MODEL_WEIGHT].shape[0]
    real = real_vocab(ckpt)
    if tokenizer_vocab > real:
        what = f"a vocabulary of {real}" + (f" ({rows} rows with padding)" if rows != real else "")
        raise UserError(f"data.tokenizer={tokenizer} has {tokenizer_vocab} tokens; the "
                         f"checkpoint {path} has {what}: use the model's own tokenizer "
                         "(data.tokenizer=HF_DIR)")
    return rows


class FineTuneStart:
    """A model-only checkpoint to start from (see the module docstring)."""

    def __init__(self, path: Path, ckpt: Checkpoint) -> None:
        self.path = path
        self.ckpt = ckpt
        self.real_vocab = real_vocab(ckpt)  # recorded again by the fine-tune's checkpoints
        # the imported model's source (its max_position_embeddings, family), for export-hf
        self.hf_source = ckpt.extra.get("hf_source")

    def vocab_size(self, tokenizer_vocab: int, tokenizer: str) -> int:
        """The vocabulary to build with: the checkpoint's, if the tokenizer fits in it."""
        return checkpoint_vocab(self.path, self.ckpt, tokenizer_vocab, tokenizer)

    def load(self, model: torch.nn.Module) -> None:
        load_fine_tune_start(self.path, model)


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
