"""The random strings RULER's tasks are made of: words, keys, numbers, UUIDs, coded words.

RULER draws its words from the `wonderwords` noun/adjective/verb lists; nothing is downloaded
here, so words are pronounceable pseudo-words from a seeded generator (alternating consonants and
vowels, 5-9 letters: "bakitu", "orevanim"), or, on request, real words from the tokenizer's own
vocabulary (alphabetic tokens of >= 4 lowercase letters that decode with a leading space, e.g.
" house" -> "house"). Keys in RULER's adjective-noun style are two words joined by '-'.

Every function draws only from the numpy Generator it is given, so a sample's strings depend on
its own seed alone.
"""

from __future__ import annotations

import re
import string
import uuid
import weakref
from collections.abc import Callable, Iterable

import numpy as np

CONSONANTS = np.array(list("bcdfghjklmnprstvz"))
VOWELS = np.array(list("aeiou"))
MIN_LETTERS, MAX_LETTERS = 5, 9
_VOCAB_WORD = re.compile(r" [a-z]{4,}")
_vocab_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def distinct(draw: Callable[[int], Iterable[str]], n: int,
             exclude: Iterable[str] = ()) -> list[str]:
    """`n` distinct strings from repeated calls of `draw(m)` (m: how many are still missing),
    in draw order, none of them in `exclude`."""
    seen = set(exclude)
    out: list[str] = []
    while len(out) < n:
        for item in draw(n - len(out)):
            if item not in seen:
                seen.add(item)
                out.append(item)
                if len(out) == n:
                    break
    return out


def _pseudo_batch(rng: np.random.Generator, m: int) -> list[str]:
    """`m` pseudo-words (maybe repeating): [m, 9] letters alternating consonant/vowel from a
    random first kind, each cut to its drawn length."""
    m = 2 * m + 8  # spare draws for duplicates
    lengths = rng.integers(MIN_LETTERS, MAX_LETTERS + 1, size=m)
    consonants = CONSONANTS[rng.integers(0, len(CONSONANTS), size=(m, MAX_LETTERS))]
    vowels = VOWELS[rng.integers(0, len(VOWELS), size=(m, MAX_LETTERS))]
    vowel_first = rng.random(m) < 0.3
    vowel_at = (np.arange(MAX_LETTERS)[None, :] + vowel_first[:, None]) % 2 == 1
    letters = np.where(vowel_at, vowels, consonants)  # [m, 9] one-letter strings
    rows = ["".join(row) for row in letters.tolist()]
    return [row[:n] for row, n in zip(rows, lengths.tolist())]


def pseudo_words(rng: np.random.Generator, n: int, exclude: Iterable[str] = ()) -> list[str]:
    """`n` distinct pronounceable lowercase pseudo-words of 5-9 letters."""
    return distinct(lambda m: _pseudo_batch(rng, m), n, exclude)


def vocab_words(tokenizer) -> list[str]:
    """The tokenizer's whole-word tokens: ids that decode alone to a space and >= 4 lowercase
    letters, without the space, sorted; cached per tokenizer object. Empty for a byte
    tokenizer."""
    try:
        return _vocab_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    found = set()
    for i in range(int(tokenizer.vocab_size)):
        try:
            text = tokenizer.decode([i])
        except Exception:  # ids a tokenizer cannot decode alone (gaps, specials) are no words
            continue
        if _VOCAB_WORD.fullmatch(text):
            found.add(text[1:])
    words = sorted(found)
    try:
        _vocab_cache[tokenizer] = words
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return words


def word_pool(rng: np.random.Generator, n: int, tokenizer=None) -> list[str]:
    """`n` distinct lowercase words: drawn from the tokenizer's vocabulary (`vocab_words`) when a
    tokenizer is given and has such words, topped up with pseudo-words when it has fewer than
    `n`; pseudo-words only without a tokenizer."""
    vocab = vocab_words(tokenizer) if tokenizer is not None else []
    if not vocab:
        return pseudo_words(rng, n)
    take = rng.choice(len(vocab), size=min(n, len(vocab)), replace=False)
    words = [vocab[i] for i in take.tolist()]
    return words + pseudo_words(rng, n - len(words), exclude=words)


def random_numbers(rng: np.random.Generator, n: int, exclude: Iterable[str] = ()) -> list[str]:
    """`n` distinct 7-digit numbers (no leading zero) as strings."""
    return distinct(lambda m: [str(v) for v in rng.integers(10**6, 10**7, size=m).tolist()],
                    n, exclude)


def random_uuids(rng: np.random.Generator, n: int, exclude: Iterable[str] = ()) -> list[str]:
    """`n` distinct version-4 UUIDs ("8-4-4-4-12" hex) from the generator's bits."""
    def draw(m: int) -> list[str]:
        raw = rng.bytes(16 * m)
        return [str(uuid.UUID(bytes=raw[16 * i:16 * i + 16], version=4)) for i in range(m)]
    return distinct(draw, n, exclude)


def random_keys(rng: np.random.Generator, n: int, tokenizer=None,
                exclude: Iterable[str] = ()) -> list[str]:
    """`n` distinct "word-word" keys (RULER's adjective-noun keys, e.g. "bakitu-orevanim")."""
    def draw(m: int) -> list[str]:
        words = word_pool(rng, 2 * m, tokenizer)
        return [f"{a}-{b}" for a, b in zip(words[::2], words[1::2])]
    return distinct(draw, n, exclude)


def random_strings(rng: np.random.Generator, n: int, kind: str, tokenizer=None,
                   exclude: Iterable[str] = ()) -> list[str]:
    """`n` distinct needle keys or values of RULER's kind: words, numbers or uuids."""
    if kind == "words":
        return random_keys(rng, n, tokenizer, exclude)
    if kind == "numbers":
        return random_numbers(rng, n, exclude)
    if kind == "uuids":
        return random_uuids(rng, n, exclude)
    raise ValueError(f"unknown needle kind {kind!r}")


def letter_strings(rng: np.random.Generator, n: int, letters: int,
                   alphabet: str = string.ascii_lowercase) -> list[str]:
    """`n` distinct strings of `letters` random letters (fwe's coded words, vt's variables)."""
    chars = np.array(list(alphabet))
    if n > len(chars) ** letters:
        raise ValueError(f"only {len(chars) ** letters} strings of {letters} letters exist")

    def draw(m: int) -> list[str]:
        grid = chars[rng.integers(0, len(chars), size=(m, letters))]
        return ["".join(row) for row in grid.tolist()]
    return distinct(draw, n)
