"""Passkey retrieval (Mohtashami & Jaggi 2023): a random key hidden in filler text.

    <filler ...> The pass key is 71432. Remember it. 71432 is the pass key. <filler ...>
    What is the pass key? The pass key is 71432

The answer is " 71432", the space included (`answer_text`): the key then tokenizes exactly as it
does in the needle, since BPE tokenizers attach a leading space to the word or number after it
("Ġ714", "32"). A question ending in "is " would ask for "714", "32" after a lone "Ġ": another
token sequence than the needle holds, which turns retrieval (copy the tokens) into copy-and-
re-split, and a small model trained on it did not learn it (docs/experiments.md, third run).

The key sits at a controlled depth (0 = start of the context, 1 = just before the question);
a model passes a trial when greedy decoding after "The pass key is" reproduces every digit.
Training mixes such samples into the corpus (`data.passkey_fraction`) at the training length,
and multi-key ones (`data.multikey_fraction`, trainer/evals/retrieval.py's task).
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.errors import UserError

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def answer_text(key: str) -> str:
    """What follows a question: the key after a space, as the needle writes it."""
    return " " + key


def random_key(rng: np.random.Generator, digits: int) -> str:
    """A key of `digits` digits, no leading zero."""
    return str(rng.integers(10 ** (digits - 1), 10 ** digits))


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the prompt is exactly `length` tokens and ends with the question.

    Filler tokens are cut to fit, so the needle starts at about `depth` of the filler span.
    """
    if not 0.0 <= depth <= 1.0:
        raise UserError(f"passkey depth must be in [0, 1], got {depth}")
    needle = tokenizer.encode(_needle(key))
    question = tokenizer.encode(QUESTION)
    budget = length - len(needle) - len(question)
    if budget < 0:
        raise UserError(f"passkey length {length} is too short for the needle and question "
                         f"({len(needle) + len(question)} tokens)")
    unit = tokenizer.encode(FILLER)
    filler = (unit * (budget // len(unit) + 1))[:budget]
    cut = int(round(depth * budget))
    prompt = filler[:cut] + needle + filler[cut:] + question
    return prompt, tokenizer.encode(answer_text(key))


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
        from trainer.evals.retrieval import place_needles

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
