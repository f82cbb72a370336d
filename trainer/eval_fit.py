"""Which `trainer.eval` task fits which length: a task that does not fit a length is skipped
there with one note (a prompt too short for its needles, a validation text too short for a
window), so the default lengths (T, 2T, 4T) run on any checkpoint the trainer can produce."""

from __future__ import annotations

import logging

import numpy as np
from omegaconf import DictConfig

from trainer.errors import UserError
from trainer.evals.passkey import passkey_prompt
from trainer.evals.retrieval import place_needles

log = logging.getLogger(__name__)


def _fits(check, length: int) -> str | None:
    """None when `check(length)` succeeds, else why not."""
    try:
        check(length)
    except UserError as err:
        return str(err)
    return None


def fitting_lengths(tokenizer, stream, e: DictConfig) -> dict[str, list[int]]:
    """The lengths of `e.lengths` each task runs at (passkey, multikey, perplexity)."""
    key = "9" * e.passkey_digits
    rng = np.random.default_rng(0)
    checks = {
        "passkey": lambda n: passkey_prompt(tokenizer, n, 0.5, key),
        "multikey": lambda n: place_needles(tokenizer, n, 0.5, e.multikey_keys, e.passkey_digits,
                                            rng, lambda k: [0] * k),
        "perplexity": lambda n: _window(stream, n),
    }
    fit: dict[str, list[int]] = {}
    for task, check in checks.items():
        fit[task], skipped = [], []
        for n in e.lengths:
            why = _fits(check, n)
            if why:
                skipped.append((n, why))
            else:
                fit[task].append(n)
        if skipped and not (task == "multikey" and e.multikey_trials == 0):
            log.warning("eval: %s skipped at length %s: %s", task,
                        ", ".join(str(n) for n, _ in skipped), skipped[0][1])
    if not any(fit.values()):
        raise UserError(f"eval.lengths={list(e.lengths)}: no task fits any of them; raise "
                        "eval.lengths")
    return fit


def _window(stream, length: int) -> None:
    if len(stream) <= length:
        raise UserError(f"the validation text ({len(stream)} tokens) is shorter than one window; "
                        "use more data (data.max_documents, data.valid_fraction)")
