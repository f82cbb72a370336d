"""Multi-key retrieval: a needle among distractors in held-out corpus text (RULER's niah_multikey).

k needles of the passkey's form, each with its own name and value, are hidden in filler drawn
from the validation token stream (text the model never trained on, not one repeated sentence):

    <corpus ...> The pass key for amber is 71432. Remember it. 71432 is the pass key for amber.
    <corpus ...> The pass key for cobalt is 30518. ... <corpus ...>
    What is the pass key for amber? The pass key for amber is

The asked needle sits at the cell's depth (0 = start of the filler, 1 = just before the
question); the k - 1 distractors at seeded random depths. A trial is correct when greedy decoding
reproduces the asked value; answering a distractor's value is counted apart (the model found a
needle, just not the one asked for). Every trial's draws depend only on (seed, length, depth
index, trial), so cells do not depend on the grid or the batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from trainer.errors import UserError
from trainer.evals.decoding import Greedy
from trainer.evals.passkey import NAMES, answer_text, random_key
from trainer.evals.results import MultiKeyCell


def needle_text(name: str, value: str) -> str:
    return f" The pass key for {name} is {value}. Remember it. {value} is the pass key for {name}. "


def question_text(name: str) -> str:
    return f" What is the pass key for {name}? The pass key for {name} is"


@dataclass
class MultiKeyTrial:
    """One prompt: exactly `length` tokens, ending with the question about `names[0]`."""

    prompt: list[int]
    names: list[str]  # names[0] is asked; the rest are distractors
    values: list[str]
    starts: list[int]  # token index where each needle begins in the prompt


def corpus_filler(stream, n_tokens: int, eod: int, rng: np.random.Generator) -> list[int]:
    """`n_tokens` consecutive validation tokens from a seeded offset, document separators left
    out (the filler reads as running text)."""
    span = 2 * n_tokens + 64  # enough after dropping separators unless documents are tiny
    if len(stream) < span:
        raise ValueError(f"validation stream ({len(stream)} tokens) is too short for "
                         f"{n_tokens} filler tokens; lower eval.lengths or use more data")
    start = int(rng.integers(0, len(stream) - span + 1))
    tokens = np.asarray(stream[start:start + span]).astype(np.int64)
    tokens = tokens[tokens != eod][:n_tokens]
    if len(tokens) < n_tokens:
        raise ValueError("validation documents are too short to draw filler from")
    return tokens.tolist()


def multikey_prompt(tokenizer, stream, length: int, depth: float, keys: int, digits: int,
                    rng: np.random.Generator) -> MultiKeyTrial:
    """A trial of `keys` needles (distinct names and values) in held-out corpus filler drawn
    from `stream`; see module doc."""
    return place_needles(tokenizer, length, depth, keys, digits, rng,
                         lambda n: corpus_filler(stream, n, tokenizer.eod, rng))


def place_needles(tokenizer, length: int, depth: float, keys: int, digits: int,
                  rng: np.random.Generator, filler: Callable[[int], list[int]]) -> MultiKeyTrial:
    """`keys` needles and the question about the first, in `filler(n)`'s n tokens: the asked
    needle at `depth` of the filler, the others at random depths; exactly `length` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if not 1 <= keys <= len(NAMES):
        raise UserError(f"eval.multikey_keys / data.multikey_keys must be in [1, {len(NAMES)}], "
                        f"got {keys}")
    names = [NAMES[i] for i in rng.choice(len(NAMES), size=keys, replace=False)]
    values: list[str] = []
    while len(values) < keys:
        value = random_key(rng, digits)
        if value not in values:
            values.append(value)
    needles = [tokenizer.encode(needle_text(n, v)) for n, v in zip(names, values)]
    question = tokenizer.encode(question_text(names[0]))
    budget = length - sum(map(len, needles)) - len(question)
    if budget < 0:
        raise UserError(f"{length} tokens are too short for {keys} needles and the question; "
                        "raise the length (eval.lengths, trainer.seq_length) or lower the keys "
                        "(eval.multikey_keys, data.multikey_keys)")
    tokens = filler(budget)
    cuts = [int(round(depth * budget))] + [int(c) for c in rng.integers(0, budget + 1, keys - 1)]
    prompt: list[int] = []
    starts = [0] * keys
    done = 0
    for i in sorted(range(keys), key=lambda i: (cuts[i], i)):  # the asked needle first on ties
        prompt += tokens[done:cuts[i]]
        done = cuts[i]
        starts[i] = len(prompt)
        prompt += needles[i]
    prompt += tokens[done:] + question
    return MultiKeyTrial(prompt, names, values, starts)


@torch.no_grad()
def multikey_accuracy(model: torch.nn.Module, tokenizer, stream, lengths: list[int],
                      depths: list[float], trials: int, keys: int, digits: int, batch_size: int,
                      seed: int, device: torch.device,
                      greedy: Greedy | None = None) -> list[MultiKeyCell]:
    """Correct and distractor answers per (length, depth) cell: greedy decoding's text starts
    with the asked value, or with a distractor's (`trainer.evals.decoding`: every depth's trials
    of a length decode together on the engine)."""
    greedy = greedy or Greedy(model, tokenizer.vocab_size, device, batch_size)
    cells = []
    for length in lengths:
        built = [multikey_prompt(tokenizer, stream, length, depth, keys, digits,
                                 np.random.default_rng((seed, 0x4E1D, length, j, t)))
                 for j, depth in enumerate(depths) for t in range(trials)]
        answers = [[answer_text(v) for v in t.values] for t in built]
        # one token per character of the longest value fits every value
        verdicts = greedy.starts_with(tokenizer, [t.prompt for t in built], answers,
                                      [max(len(a) for a in row) for row in answers],
                                      progress=f"multikey {length}")
        for j, depth in enumerate(depths):
            cell = verdicts[j * trials:(j + 1) * trials]
            cells.append(MultiKeyCell(length, depth, sum(asked for asked, *_ in cell),
                                      sum(any(others) for _, *others in cell), trials, keys))
    return cells
