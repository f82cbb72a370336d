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

from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from ckpt.destination import stranded_note
from ckpt.paths import resolve_checkpoint
from ckpt.reader import MODEL_WEIGHT, Checkpoint, CheckpointError
from ckpt.saved_config import literal
from trainer.config import command_line_overrides
from trainer.errors import UserError
from trainer.rope_override import typed_model_keys, with_rope_overrides


def check_load_exists(load: str) -> None:
    """Refuse a `checkpoint.load` that names nothing (the entry points call it before megatron's
    imports; `open_load` again)."""
    if not Path(load).exists():
        raise UserError(f"checkpoint.load={load}: no such file or directory; give a checkpoints "
                        "root (e.g. outputs/<date>/<time>/checkpoints) or one iter_* directory"
                        + stranded_note(Path(load)))


def open_load(load: str) -> Checkpoint:
    """The checkpoint `checkpoint.load` names, resolved and opened once for the whole start
    (its record read and checked); the run reads everything it needs from this object."""
    check_load_exists(load)
    try:
        ckpt = Checkpoint(resolve_checkpoint(load))
        ckpt.meta  # noqa: B018 (a record that cannot be read is refused here, first)
    except (FileNotFoundError, CheckpointError) as err:
        raise UserError(f"checkpoint.load={load}: {err}") from err
    return ckpt


def checkpoint_vocab(ckpt: Checkpoint, tokenizer_vocab: int, tokenizer: str) -> int:
    """The vocabulary to build the checkpoint's model with: its embedding rows (the padded
    vocabulary), if the tokenizer's ids fit the model's real vocabulary (`meta.vocab_size`);
    refused naming both sizes otherwise."""
    rows = ckpt.tensors[MODEL_WEIGHT].shape[0]
    real = ckpt.meta.vocab_size
    if tokenizer_vocab > real:
        what = f"a vocabulary of {real}" + (f" ({rows} rows with padding)" if rows != real else "")
        raise UserError(f"data.tokenizer={tokenizer} has {tokenizer_vocab} tokens; the "
                        f"checkpoint {ckpt.path} has {what}: use the model's own tokenizer "
                        "(data.tokenizer=HF_DIR)")
    return rows


class FineTuneStart:
    """A model-only checkpoint to start from (see the module docstring)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    @property
    def path(self) -> Path:
        return self.ckpt.path

    def vocab_size(self, tokenizer_vocab: int, tokenizer: str) -> int:
        """The vocabulary to build with: the checkpoint's, if the tokenizer fits in it."""
        return checkpoint_vocab(self.ckpt, tokenizer_vocab, tokenizer)

    def load(self, model: torch.nn.Module) -> None:
        from ckpt.load import load_fine_tune_start  # megatron: after a command's checks

        load_fine_tune_start(self.ckpt, model)


def adopt_saved_model(cfg: DictConfig, ckpt: Checkpoint) -> FineTuneStart | None:
    """Set `cfg.model` from the checkpoint's record (refusing a different chosen model);
    returns the start when the checkpoint is model-only, else None (a resume)."""
    meta = ckpt.meta
    # The saved model, with the run's model.rope_* (they change no parameter; a different
    # chosen model is refused, listing the differing settings): trainer/rope_override.py.
    typed = typed_model_keys(command_line_overrides())
    model = with_rope_overrides(cfg.model, literal(asdict(meta.model)), typed, meta.seq_length,
                                cfg.trainer.seq_length)
    with open_dict(cfg):
        cfg.model = model
    return FineTuneStart(ckpt) if meta.model_only else None
