"""Haystacks: the caller's running text (RULER's "essay" haystack) and needle insertion.

RULER fills its essay haystacks with Paul Graham's essays; here the caller gives the text (the
evaluation's validation corpus decoded to text, say): a string, a list of documents, or a
callable returning either, called once. The text is whitespace-normalised and cut into words as
RULER does; a haystack of n words is n consecutive words from a seeded offset (wrapping around
when the text is shorter), so different samples read different parts of the corpus (RULER
always starts at the first word). Sentences come from a small regex splitter (end punctuation
then whitespace) instead of nltk's punkt; overlong ones (a code corpus) are cut every 64 words.
The text is split into words once: a few MB of it is plenty (1M words fill ~1.3M tokens).

Needles go in as RULER places them:
    essay haystacks: between sentences, at depths drawn without replacement from RULER's 40
        depths (0%, 3%, ..., 100% of the sentences), the text joined with spaces;
    line haystacks (noise, distractor needles): at distinct random line positions, the lines
        joined with newlines.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from trainer.errors import UserError
from trainer.evals.ruler.templates import DEPTHS

TextSource = str | Sequence[str] | Callable[[], str | Sequence[str]]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
MAX_SENTENCE_WORDS = 64


class EssayText:
    """The caller's text as one list of words (built once; a corpus is split once)."""

    def __init__(self, source: TextSource) -> None:
        text = source() if callable(source) else source
        if not isinstance(text, str):
            text = "\n".join(text)
        self.words = re.sub(r"\s+", " ", text).strip().split(" ") if text.strip() else []
        if not self.words:
            raise UserError("the RULER haystack text (text_source) is empty")

    def take(self, rng: np.random.Generator, n: int) -> str:
        """`n` consecutive words from a random offset, wrapping around, joined by spaces."""
        if n <= 0:
            return ""
        start = int(rng.integers(0, len(self.words)))
        out: list[str] = []
        while len(out) < n:
            out += self.words[start:start + n - len(out)]
            start = 0
        return " ".join(out)


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`: split after '.', '!' or '?' followed by whitespace; a "sentence"
    of more than MAX_SENTENCE_WORDS words (code, tables: text without sentence ends) is cut
    into pieces of that many words, so needle depths stay spread over such text too."""
    out = []
    for sentence in _SENTENCE_END.split(text.strip()):
        words = sentence.split(" ")
        out += [" ".join(words[i:i + MAX_SENTENCE_WORDS])
                for i in range(0, len(words), MAX_SENTENCE_WORDS) if sentence]
    return out


def insert_at_depths(rng: np.random.Generator, sentences: list[str],
                     needles: list[str]) -> str:
    """`needles` (in order) between `sentences`, at sorted depths drawn from RULER's 40 (with
    replacement only when there are more than 40 needles); one space between pieces."""
    depths = rng.choice(DEPTHS, size=len(needles), replace=len(needles) > len(DEPTHS))
    cuts = sorted(int(len(sentences) * int(d) / 100) for d in depths)
    pieces: list[str] = []
    last = 0
    for cut, needle in zip(cuts, needles):
        pieces += sentences[last:cut] + [needle]
        last = cut
    pieces += sentences[last:]
    return " ".join(pieces)


def insert_lines(rng: np.random.Generator, lines: list[str], items: list[str]) -> list[str]:
    """`lines` with `items` inserted in order at distinct random positions (0..len(lines)),
    repeated positions only when there are more items than positions."""
    m = len(items)
    slots = len(lines) + 1
    positions = np.sort(rng.choice(slots, size=m, replace=m > slots)).tolist()
    out = list(lines)
    for j, (position, item) in enumerate(zip(positions, items)):
        out.insert(position + j, item)  # + j: the items already inserted before it
    return out
