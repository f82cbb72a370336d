"""Passkey retrieval (Mohtashami & Jaggi 2023): a random key hidden in filler text.

    <filler ...> The pass key is 71432. Remember it. 71432 is the pass key. <filler ...>
    What is the pass key? The pass key is 71432

The answer is " 71432", the space included (`answer_text`): the key then tokenizes exactly as it
does in the needle, since BPE tokenizers attach a leading space to the word or number after it
("Ġ714", "32"). A question ending in "is " would ask for "714", "32" after a lone "Ġ": another
token sequence than the needle holds, which turns retrieval (copy the tokens) into copy-and-
re-split, and a small model trained on it did not learn it.

The key sits at a controlled depth (0 = start of the context, 1 = just before the question);
a model passes a trial when greedy decoding after "The pass key is" reproduces every digit.
Training mixes such samples into the corpus (`data.passkey_fraction`) at the training length,
and multi-key ones (`data.multikey_fraction`, trainer/evals/retrieval.py's task):
trainer/evals/retrieval_mix.py.
"""

from __future__ import annotations

import numpy as np

from trainer.errors import UserError

# The multi-key task's key names (trainer/evals/retrieval.py); here, apart from the decoding
# that retrieval imports (megatron), so that trainer.eval's settings check needs no megatron
NAMES = ("amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo",
         "juniper", "kestrel", "lagoon", "marble", "nectar", "onyx", "pepper", "quartz",
         "raven", "saffron", "tundra", "umber", "violet", "willow", "yarrow", "zephyr")

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
