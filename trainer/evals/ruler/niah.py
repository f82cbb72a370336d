"""Needle-in-a-haystack prompts (RULER's niah.py: the eight niah_* tasks).

Needles read "One of the special magic numbers for bakitu-orevanim is: 4821937." Each of
max(num_keys, num_queries) keys gets num_values values, one needle per value; the needles are
shuffled and hidden in the haystack, and num_queries of the keys are asked about together:

    Some special magic numbers are hidden within the following text. ...
    <haystack with needles>
    What are all the special magic numbers for K1, K2, and K3 mentioned in the provided text?
     The special magic numbers for K1, K2, and K3 mentioned in the provided text are

With a single value asked (num_queries * num_values == 1) RULER rewords the strings in the
singular ("A special magic number is hidden ..."). The references are the asked keys' values.
Keys and values are drawn before the haystack, so they do not change with its size; distractor
needles (haystack 'needle') have keys and values distinct from the real ones, so every value
asked for appears in exactly one needle.
"""

from __future__ import annotations

import numpy as np

from trainer.evals.ruler.haystack import insert_at_depths, insert_lines, split_sentences
from trainer.evals.ruler.specs import Draft, NiahSpec
from trainer.evals.ruler.templates import NEEDLE, NIAH_PREFIX, NIAH_TEMPLATE, NOISE, singular_niah
from trainer.evals.ruler.words import random_strings


def join_query(keys: list[str]) -> str:
    """RULER's list of asked keys: "a", or "a, b, and c"."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def generate(spec: NiahSpec, rng: np.random.Generator, size: int, length: int, index: int,
             ctx) -> Draft:
    """One niah prompt whose haystack has `size` units (lines, words or distractor needles)."""
    n_keys = max(spec.num_keys, spec.num_queries)
    kind = spec.value_type  # "numbers": the plural the needles use
    words = ctx.word_tokenizer
    keys = random_strings(rng, n_keys, spec.key_type, words)
    values = random_strings(rng, n_keys * spec.num_values, spec.value_type, words)
    by_key = [values[i * spec.num_values:(i + 1) * spec.num_values] for i in range(n_keys)]
    needles = [NEEDLE.format(type_needle_v=kind, key=key, value=value)
               for key, vals in zip(keys, by_key) for value in vals]
    needles = [needles[i] for i in rng.permutation(len(needles)).tolist()]
    asked = rng.choice(n_keys, size=spec.num_queries, replace=False).tolist()
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in by_key[i]]

    if spec.haystack == "essay":
        sentences = split_sentences(ctx.essay(rng, size))
        context = insert_at_depths(rng, sentences, needles)
    else:
        if spec.haystack == "noise":
            lines = [NOISE] * size
        else:  # distractor needles: fresh keys and values, none equal to a real one
            real = keys + values
            fake_keys = random_strings(rng, size, spec.key_type, words, exclude=real)
            fake_values = random_strings(rng, size, spec.value_type, words, exclude=real)
            lines = [NEEDLE.format(type_needle_v=kind, key=k, value=v)
                     for k, v in zip(fake_keys, fake_values)]
        context = "\n".join(insert_lines(rng, lines, needles))

    template, prefix = NIAH_TEMPLATE, NIAH_PREFIX
    if spec.num_queries * spec.num_values == 1:
        template, prefix, kind = singular_niah(template), singular_niah(prefix), kind[:-1]
    query = join_query(queries)
    return Draft(text=template.format(type_needle_v=kind, context=context, query=query),
                 answer_prefix=prefix.format(type_needle_v=kind, query=query),
                 references=answers)
