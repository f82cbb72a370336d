"""Retrieval examples mixed into the training stream: passkey examples (trainer/evals/passkey.py)
and multi-key examples in the sample's own text (trainer/evals/retrieval.py's task), each
ending with its answer, so a model learns at the training length the task its evaluation asks
at longer ones."""

from __future__ import annotations

import numpy as np
import torch

from trainer.errors import UserError
from trainer.evals.passkey import FILLER, answer_text, passkey_prompt, random_key
from trainer.evals.retrieval import place_needles


class PasskeyMix:
    """Replaces a deterministic share of the training stream by retrieval examples: passkey
    examples (`fraction`) and multi-key examples (`multikey_fraction`: `keys` named needles in
    the replaced sample's own text, the question about one of them, as `trainer/evals/retrieval.py`
    evaluates in held-out text), each ending with its answer.

    Global sample g's choice, keys and depths depend only on (seed, g), the training stream's
    position: every epoch over a small corpus brings new keys (a choice keyed by the dataset
    index would repeat the same few hundred keys each epoch, which a model memorises instead of
    learning to retrieve), and resuming at any `consumed_samples` reproduces the same stream.
    """

    def __init__(self, tokenizer, fraction: float, seq_length: int, seed: int,
                 digits: int = 5, multikey_fraction: float = 0.0, keys: int = 4) -> None:
        if not (0.0 <= fraction and 0.0 <= multikey_fraction
                and fraction + multikey_fraction <= 1.0):
            raise UserError(f"data.passkey_fraction ({fraction}) and data.multikey_fraction "
                            f"({multikey_fraction}) must be >= 0 and sum to at most 1")
        self.tokenizer, self.fraction, self.multikey_fraction = tokenizer, fraction, \
            multikey_fraction
        self.seq_length, self.seed, self.digits, self.keys = seq_length, seed, digits, keys
        if multikey_fraction > 0:  # refuse a length too short for the needles now, not mid-run
            self._multikey(np.random.default_rng(0), torch.zeros(seq_length + 1, dtype=torch.int64))

    def __call__(self, g: int, sample: torch.Tensor) -> torch.Tensor:
        rng = np.random.default_rng((self.seed, 0x9A55, g))
        u = rng.random()
        if u >= self.fraction + self.multikey_fraction:
            return sample
        if u >= self.fraction:
            return self._multikey(rng, sample)
        key = random_key(rng, self.digits)
        # seq_length + 1 tokens (inputs and shifted labels); the key's tokens end the sample.
        n_answer = len(self.tokenizer.encode(answer_text(key)))
        prompt, answer = passkey_prompt(self.tokenizer, self.seq_length + 1 - n_answer,
                                        float(rng.random()), key)
        return torch.tensor(prompt + answer, dtype=torch.int64)

    def _multikey(self, rng: np.random.Generator, sample: torch.Tensor) -> torch.Tensor:
        """Needles in the sample's own text (document separators left out), the answer last;
        filler in front makes up for an answer shorter than its longest tokenization."""
        own = [t for t in sample.tolist() if t != self.tokenizer.eod] \
            or self.tokenizer.encode(FILLER)
        longest = self.digits + 1  # answer_text's characters: at most that many tokens
        total = self.seq_length + 1

        def filler(n: int) -> list[int]:
            return (own * (n // len(own) + 1))[:n]

        trial = place_needles(self.tokenizer, total - longest, float(rng.random()), self.keys,
                              self.digits, rng, filler)
        answer = self.tokenizer.encode(answer_text(trial.values[0]))
        front = filler(total - len(trial.prompt) - len(answer))
        return torch.tensor(front + trial.prompt + answer, dtype=torch.int64)
