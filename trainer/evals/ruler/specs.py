"""RULER's 13 tasks as typed specs (one frozen dataclass per task family) and the registry.

A spec says what a task's samples look like (RULER's scripts/synthetic.yaml settings); the
family's module generates them (`niah.py`, `variable_tracking.py`, `aggregation.py`, `qa.py`).
Each family grows its prompt by one integer, its *size*, which `fit.py` searches so that
prompt tokens + `tokens_to_generate` <= the tested length:

    niah  noise haystack: lines of RULER's noise paragraph; essay: words of the caller's text;
          needle haystack: distractor needles
    vt    noise lines (or essay words)
    cwe   distinct words in the list (the first `num_cw` common, the rest rare)
    fwe   the Zipf sample's size (RULER's num_words)
    qa    documents besides the question's own

Specs are frozen (hashable): a fitted size is cached per spec, so a configured variant never
shares a cache entry with the default one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from trainer.errors import UserError
from trainer.evals.ruler.templates import TOKENS_TO_GENERATE
from trainer.evals.ruler.zipf import fwe_min_words

NEEDLE_KINDS = ("words", "numbers", "uuids")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def task_id(name: str) -> int:
    """A stable integer per task name (CRC-32 of its UTF-8 bytes), part of every sample's seed."""
    return zlib.crc32(name.encode("utf-8"))


@dataclass(frozen=True)
class NiahSpec:
    """Needle in a haystack: `num_keys` keys with `num_values` values each, `num_queries` asked
    (max(num_keys, num_queries) keys are hidden, as RULER does).

    haystack: 'noise' (RULER's noise paragraph repeated), 'essay' (the caller's text) or
    'needle' (distractor needles of the same form); keys/values: 'words' | 'numbers' | 'uuids'.
    """

    name: str
    haystack: str = "essay"
    key_type: str = "words"
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    family = "niah"
    metric = "string_match_all"
    probe_size = 24

    def __post_init__(self) -> None:
        _check(self.haystack in ("noise", "essay", "needle"),
               f"{self.name}: haystack must be noise, essay or needle, not {self.haystack!r}")
        for kind in (self.key_type, self.value_type):
            _check(kind in NEEDLE_KINDS, f"{self.name}: needle kind {kind!r} is not one of "
                   f"{NEEDLE_KINDS}")
        for count in ("num_keys", "num_values", "num_queries"):
            _check(getattr(self, count) >= 1, f"{self.name}: {count} must be >= 1")

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE["niah"]

    @property
    def needs_text(self) -> bool:
        return self.haystack == "essay"

    def min_size(self, length: int) -> int:
        return 0


@dataclass(frozen=True)
class VariableTrackingSpec:
    """Variable tracking: `num_chains` chains of `num_hops` assignments `VAR B = VAR A` from
    `VAR A = 12345`, in a 'noise' (or 'essay') haystack; RULER's one-shot example first when
    `icl` (fitted to `icl_tokens`, as RULER builds it for 500 tokens)."""

    name: str
    haystack: str = "noise"
    num_chains: int = 1
    num_hops: int = 4
    icl: bool = True
    icl_tokens: int = 500
    family = "variable_tracking"
    metric = "string_match_all"
    probe_size = 24

    def __post_init__(self) -> None:
        _check(self.haystack in ("noise", "essay"),
               f"{self.name}: haystack must be noise or essay, not {self.haystack!r}")
        _check(self.num_chains >= 1 and self.num_hops >= 1,
               f"{self.name}: num_chains and num_hops must be >= 1")

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE["variable_tracking"]

    @property
    def needs_text(self) -> bool:
        return self.haystack == "essay"

    def min_size(self, length: int) -> int:
        return 0


@dataclass(frozen=True)
class CommonWordsSpec:
    """Common words extraction: `num_cw` words `freq_cw` times each among others `freq_ucw`
    times, as a shuffled numbered list; below `short_below` tokens RULER's smaller variant
    (`short_freq_cw`, `short_freq_ucw`). One-shot examples: (words, common, rare repeats)."""

    name: str
    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    short_below: int = 4096
    short_freq_cw: int = 6
    short_freq_ucw: int = 1
    num_fewshot: int = 1
    example: tuple[int, int, int] = (40, 10, 3)
    short_example: tuple[int, int, int] = (20, 3, 1)
    family = "common_words_extraction"
    metric = "string_match_all"
    probe_size = 64

    def __post_init__(self) -> None:
        _check(self.num_cw >= 1, f"{self.name}: num_cw must be >= 1")
        _check(self.freq_cw > self.freq_ucw >= 1 and self.short_freq_cw > self.short_freq_ucw >= 1,
               f"{self.name}: the common words must repeat more often than the rare ones (>= 1)")
        for n, common, rare in (self.example, self.short_example):
            _check(n > self.num_cw and common > rare >= 1, f"{self.name}: an example needs more "
                   f"than num_cw words, common repeats above rare ones")
        _check(self.num_fewshot >= 0, f"{self.name}: num_fewshot must be >= 0")

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE["common_words_extraction"]

    needs_text = False

    def min_size(self, length: int) -> int:
        return self.num_cw


@dataclass(frozen=True)
class FrequentWordsSpec:
    """Frequent words extraction: coded words of `word_length` letters drawn with Zipf counts
    (exponent `alpha`); the top-ranked word is replaced by '...', the answer is ranks 2-4.
    `vocab_size` None: RULER's (length - tokens_to_generate) // 50."""

    name: str
    alpha: float = 2.0
    word_length: int = 6
    vocab_size: int | None = None
    family = "freq_words_extraction"
    metric = "string_match_all"
    probe_size = 400

    def __post_init__(self) -> None:
        _check(self.alpha > 1.0, f"{self.name}: alpha must be > 1 (the Zipf sum diverges)")
        _check(self.word_length >= 3, f"{self.name}: word_length must be >= 3")
        _check(self.vocab_size is None or self.vocab_size >= 5,
               f"{self.name}: vocab_size must be >= 5")

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE["freq_words_extraction"]

    needs_text = False

    def min_size(self, length: int) -> int:
        return fwe_min_words(self.alpha)


@dataclass(frozen=True)
class QASpec:
    """Question answering over documents: `dataset` 'squad' (qa_1) or 'hotpotqa' (qa_2), read
    from `path` (set by `select_tasks`); the question's own documents plus distractors."""

    name: str
    dataset: str = "squad"
    path: str | None = None
    family = "qa"
    metric = "string_match_part"
    probe_size = 4

    def __post_init__(self) -> None:
        _check(self.dataset in ("squad", "hotpotqa"),
               f"{self.name}: dataset must be squad or hotpotqa, not {self.dataset!r}")

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE["qa"]

    needs_text = False

    def min_size(self, length: int) -> int:
        return 0


TaskSpec = NiahSpec | VariableTrackingSpec | CommonWordsSpec | FrequentWordsSpec | QASpec

# RULER's 13 tasks with its default settings (scripts/synthetic.yaml).
REGISTRY: dict[str, TaskSpec] = {spec.name: spec for spec in (
    NiahSpec("niah_single_1", haystack="noise"),
    NiahSpec("niah_single_2", haystack="essay"),
    NiahSpec("niah_single_3", haystack="essay", value_type="uuids"),
    NiahSpec("niah_multikey_1", haystack="essay", num_keys=4),
    NiahSpec("niah_multikey_2", haystack="needle"),
    NiahSpec("niah_multikey_3", haystack="needle", key_type="uuids", value_type="uuids"),
    NiahSpec("niah_multivalue", haystack="essay", num_values=4),
    NiahSpec("niah_multiquery", haystack="essay", num_queries=4),
    VariableTrackingSpec("vt"),
    CommonWordsSpec("cwe"),
    FrequentWordsSpec("fwe"),
    QASpec("qa_1", dataset="squad"),
    QASpec("qa_2", dataset="hotpotqa"),
)}


@dataclass(frozen=True)
class Draft:
    """A task's generated text before the prompt format: the user message and the answer."""

    text: str  # the filled task template (any one-shot example first)
    answer_prefix: str  # RULER's answer prefix, filled in; the prompt ends with it
    references: list[str]  # what the answer must contain


@dataclass
class Sample:
    """One evaluation input: the full prompt, its tokens and the expected answers."""

    task: str
    length: int  # the tested length: len(prompt_ids) + max_new_tokens <= length
    index: int
    input: str  # the full prompt as given to the model, ending with the answer prefix
    answer_prefix: str
    prompt_ids: list[int]
    references: list[str]
    max_new_tokens: int
    metric: str  # "string_match_all" | "string_match_part" (scoring.METRICS)
