"""Aggregation prompts: common words (cwe) and frequent coded words (fwe), after RULER's
common_words_extraction.py and freq_words_extraction.py.

cwe: `size` distinct words; the first num_cw are repeated freq_cw times, the others freq_ucw
times, shuffled into a numbered list "1. bakitu 2. orevanim 3. ...". Below `short_below` tokens
RULER's smaller variant (6 and 1 repeats). One-shot examples come first: the same task over a
short list (40 words, 10 and 3 repeats; 20 words, 3 and 1 below `short_below`) with its answer
"1. w1 2. w2 ... 10. w10"; the example's words differ from the task's. References: the num_cw
common words.

fwe: a vocabulary of distinct random `word_length`-letter coded words, ranked at random; word of
rank k appears int(size * k^-alpha / zeta(alpha)) times (a Zipf sample of about `size` words),
shuffled and joined by spaces. The top-ranked word is replaced by '...' (noise the question
says to ignore); the references are ranks 2-4. The vocabulary has (length -
tokens_to_generate) // 50 words unless the spec fixes it, as RULER sizes it.
"""

from __future__ import annotations

import numpy as np

from trainer.evals.ruler.specs import CommonWordsSpec, Draft, FrequentWordsSpec
from trainer.evals.ruler.templates import CWE_PREFIX, CWE_TEMPLATE, FWE_PREFIX, FWE_TEMPLATE
from trainer.evals.ruler.words import letter_strings
from trainer.evals.ruler.zipf import zipf_counts


def numbered(words: list[str]) -> str:
    """RULER's numbered list: "1. a 2. b 3. c"."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def word_list(rng: np.random.Generator, words: list[str], num_cw: int, common: int,
              rare: int) -> str:
    """The numbered list: words[:num_cw] `common` times each, the rest `rare` times, shuffled."""
    items = words[:num_cw] * common + words[num_cw:] * rare
    return numbered([items[i] for i in rng.permutation(len(items)).tolist()])


def generate_cwe(spec: CommonWordsSpec, rng: np.random.Generator, size: int, length: int,
                 index: int, ctx) -> Draft:
    """One cwe prompt listing `size` distinct words, one-shot example(s) first."""
    short = length < spec.short_below
    n_ex, ex_common, ex_rare = spec.short_example if short else spec.example
    common, rare = ((spec.short_freq_cw, spec.short_freq_ucw) if short
                    else (spec.freq_cw, spec.freq_ucw))
    pool = ctx.words(rng, n_ex * spec.num_fewshot + size)
    task_words, pool = pool[:size], pool[size:]
    shots = []
    for k in range(spec.num_fewshot):
        words = pool[k * n_ex:(k + 1) * n_ex]
        shots.append(CWE_TEMPLATE.format(num_cw=spec.num_cw,
                                         context=word_list(rng, words, spec.num_cw,
                                                           ex_common, ex_rare))
                     + CWE_PREFIX.format(num_cw=spec.num_cw) + " "
                     + numbered(words[:spec.num_cw]))
    text = CWE_TEMPLATE.format(num_cw=spec.num_cw,
                               context=word_list(rng, task_words, spec.num_cw, common, rare))
    return Draft(text="\n".join(shots) + "\n" + text if shots else text,
                 answer_prefix=CWE_PREFIX.format(num_cw=spec.num_cw),
                 references=task_words[:spec.num_cw])


def fwe_vocab_size(spec: FrequentWordsSpec, length: int) -> int:
    """RULER's vocabulary: (length - tokens_to_generate) // 50 words, at least 5."""
    if spec.vocab_size is not None:
        return spec.vocab_size
    return max(5, (length - spec.tokens_to_generate) // 50)


def generate_fwe(spec: FrequentWordsSpec, rng: np.random.Generator, size: int, length: int,
                 index: int, ctx) -> Draft:
    """One fwe prompt: a Zipf sample of about `size` coded words."""
    vocab = letter_strings(rng, fwe_vocab_size(spec, length), spec.word_length)
    vocab[0] = "..."  # the top-ranked word is noise
    counts = zipf_counts(size, spec.alpha, len(vocab))
    items = [w for w, c in zip(vocab, counts.tolist()) for _ in range(c)]
    items = [items[i] for i in rng.permutation(len(items)).tolist()]
    return Draft(text=FWE_TEMPLATE.format(context=" ".join(items)), answer_prefix=FWE_PREFIX,
                 references=vocab[1:4])
