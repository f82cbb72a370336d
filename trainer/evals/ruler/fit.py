"""Fitting prompts to a length, and the per-sample randomness.

RULER's rule: a prompt's tokens + the task's tokens_to_generate <= the tested length. RULER
binary-searches the haystack size with trial prompts and then, per sample, steps the size down
until that sample's prompt fits. Here:

1. Per (task spec, length, prompt format, seed, tokenizer) the size is searched once on a probe
   prompt and cached (`Context.fitted`): the smallest size is measured first (too long: a
   UserError naming the task, the length and the minimum length), then a second size gives
   tokens per unit, then `fitting_search` closes in (secant steps inside a shrinking bracket).
2. Each sample starts from that size and moves down (over the budget) or up (more than ~1%
   under) the same way, so every prompt fits and sits within about 1% of its budget.

Both searches run for every (task, length) and every sample in lockstep (`run_searches`): each
round's prompts are tokenized together by the tokenizer's `encode_batch`, on all cores, while
each search tries exactly the sizes it would try alone.

Determinism: a sample's draws all come from numpy.random.default_rng((seed, task_id, length,
index)), a fresh generator for each size tried, so the prompt is a function of those and of its
size alone: the same for the same (seed, task, length, index), whatever else is generated. The
probe uses (seed, task_id, length, 0, 1), a key no sample has.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.errors import UserError
from trainer.evals.ruler import aggregation, niah, qa, variable_tracking
from trainer.evals.ruler.haystack import EssayText, TextSource
from trainer.evals.ruler.specs import (
    CommonWordsSpec,
    Draft,
    FrequentWordsSpec,
    NiahSpec,
    QASpec,
    Sample,
    TaskSpec,
    VariableTrackingSpec,
    task_id,
)
from trainer.evals.ruler.templates import PromptFormat
from trainer.evals.ruler.words import word_pool

GENERATORS = {NiahSpec: niah.generate, VariableTrackingSpec: variable_tracking.generate,
              CommonWordsSpec: aggregation.generate_cwe,
              FrequentWordsSpec: aggregation.generate_fwe, QASpec: qa.generate}
MAX_STEPS = 64
SAMPLE_SLACK = 0.01  # a sample within this fraction of its budget is not grown further


def sample_rng(seed: int, task: str, length: int, index: int) -> np.random.Generator:
    """The generator of sample `index` of `task` at `length`."""
    return np.random.default_rng((seed, task_id(task), length, index))


def probe_rng(seed: int, task: str, length: int) -> np.random.Generator:
    """The generator of the probe prompts a (task, length)'s size is searched with."""
    return np.random.default_rng((seed, task_id(task), length, 0, 1))


def fitting_search(budget: int, start: int, per_unit: float, floor: int = 0,
                   tolerance: int = 0) -> Generator[int, int, tuple[int, int] | None]:
    """The search for the largest size >= `floor` whose prompt is <= `budget` tokens, as a
    generator: it yields the next size to measure and is sent that size's token count; it
    returns (size, tokens), or None when `floor` is over the budget.

    Secant steps from `start` (tokens per unit re-estimated from the last two sizes), kept in
    the middle half of the bracket (largest fitting, smallest over) once both ends are known;
    stops when the bracket closes or a fitting size is within `tolerance` tokens of the budget.
    A generator, so that many searches can run in lockstep (`run_searches`): their prompts are
    encoded together, in parallel, and each tries the sizes it would try alone.
    """
    best = None  # (size, tokens): the largest size seen that fits
    over = None  # the smallest size seen over the budget
    size, last = max(start, floor), None
    for _ in range(MAX_STEPS):
        tokens = yield size
        if last is not None and size != last[0] and (tokens - last[1]) / (size - last[0]) > 0:
            per_unit = (tokens - last[1]) / (size - last[0])
        last = (size, tokens)
        if tokens <= budget:
            if best is None or size > best[0]:
                best = (size, tokens)
            if budget - tokens <= tolerance:
                break
            guess = size + max(1, int((budget - tokens) / per_unit))
        else:
            over = size if over is None else min(over, size)
            if size == floor:
                return None
            guess = size - max(1, math.ceil((tokens - budget) / per_unit))
        low = best[0] + 1 if best is not None else floor
        if over is None:
            guess = max(guess, low)
        else:
            high = over - 1
            if low > high:
                break
            quarter = (high - low) // 4
            guess = min(max(guess, low + quarter), high - quarter)
        size = guess
    if best is None:  # out of steps before anything fitted: the floor decides
        tokens = yield floor
        return (floor, tokens) if tokens <= budget else None
    return best


def run_searches(searches: list[Generator[int, int, Any]],
                 measure_many: Callable[[list[tuple[int, int]]], list[int]],
                 finished: Callable[[int], None] | None = None) -> list[Any]:
    """Drive `searches` in lockstep: each round, measure_many([(search index, size), ...])
    gives the token counts of every unfinished search's next size; returns their results
    (`finished(i)` as search i ends)."""
    results: list[Any] = [None] * len(searches)
    pending: dict[int, int] = {}
    for i, search in enumerate(searches):
        try:
            pending[i] = next(search)
        except StopIteration as done:
            results[i] = done.value
    while pending:
        asked = list(pending.items())
        for (i, _), tokens in zip(asked, measure_many(asked)):
            try:
                pending[i] = searches[i].send(tokens)
            except StopIteration as done:
                results[i] = done.value
                del pending[i]
                if finished is not None:
                    finished(i)
    return results


def largest_fitting(measure: Callable[[int], tuple[int, object]], budget: int, start: int,
                    per_unit: float, floor: int = 0, tolerance: int = 0):
    """(size, tokens, payload) of `fitting_search`'s answer, measured one size at a time by
    `measure(size)` -> (tokens, payload); None when `floor` is over the budget."""
    payloads: dict[int, object] = {}

    def measure_many(asked: list[tuple[int, int]]) -> list[int]:
        (_, size), = asked
        tokens, payloads[size] = measure(size)
        return [tokens]

    found, = run_searches([fitting_search(budget, start, per_unit, floor, tolerance)],
                          measure_many)
    return None if found is None else (*found, payloads[found[0]])


@dataclass(frozen=True)
class Fitted:
    """A (task, length)'s searched haystack size."""

    size: int
    per_unit: float  # tokens per unit of size, near the fitted size


class Context:
    """What generation needs besides the spec: the tokenizer, the prompt format, the seed, the
    haystack text, where words come from, and the cache of fitted sizes."""

    def __init__(self, tokenizer, seed: int, prompt: PromptFormat,
                 text_source: TextSource | None = None, vocab_words: bool = False,
                 cache: dict | None = None) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise UserError(f"the RULER seed must be a non-negative integer, got {seed!r}")
        self.tokenizer = tokenizer
        self.seed = seed
        self.prompt = prompt
        self._source = text_source
        self._essay: EssayText | None = None
        self.word_tokenizer = tokenizer if vocab_words else None
        self.cache = {} if cache is None else cache
        # what a fitted size depends on besides the spec, length and format
        self._tokenizer_key = (getattr(tokenizer, "name", None) or id(tokenizer), vocab_words)

    # -- what generators call -------------------------------------------------------------
    def words(self, rng: np.random.Generator, n: int) -> list[str]:
        """`n` distinct words (words.word_pool; the vocabulary's when asked for)."""
        return word_pool(rng, n, self.word_tokenizer)

    def essay(self, rng: np.random.Generator, n_words: int) -> str:
        """`n_words` consecutive words of the haystack text."""
        if n_words <= 0:
            return ""
        if self._essay is None:
            if self._source is None:
                raise UserError("RULER's essay-haystack tasks need haystack text: pass "
                                "text_source (e.g. the validation corpus as text)")
            self._essay = EssayText(self._source)
        return self._essay.take(rng, n_words)

    def example_size(self, key: Hashable, budget: int,
                     build: Callable[[np.random.Generator, int], str]) -> int:
        """The largest haystack size whose `build(rng, size)` text is <= `budget` tokens
        (a one-shot example's), searched once per key on a probe generator."""
        full_key = ("example", key, budget, self.seed, self._tokenizer_key)
        if full_key not in self.cache:
            def measure(size: int) -> tuple[int, None]:
                text = build(np.random.default_rng((self.seed, task_id(str(key)), 0, 0, 2)),
                             size)
                return len(self.tokenizer.encode(text)), None
            base = measure(0)[0]
            per_unit = max(1.0, (measure(8)[0] - base) / 8)
            found = largest_fitting(measure, budget, int((budget - base) / per_unit), per_unit)
            self.cache[full_key] = 0 if found is None else found[0]
        return self.cache[full_key]

    # -- prompts ----------------------------------------------------------------------------
    def draft(self, spec: TaskSpec, rng: np.random.Generator, size: int, length: int,
              index: int) -> Draft:
        return GENERATORS[type(spec)](spec, rng, size, length, index, self)

    def encode_draft(self, draft: Draft) -> tuple[str, list[int]]:
        return self.encode_drafts([draft])[0]

    def encode_drafts(self, drafts: list[Draft]) -> list[tuple[str, list[int]]]:
        """Each draft's prompt text and tokens; several at once through the tokenizer's
        `encode_batch` (in parallel inside `tokenizers`) where it has one."""
        texts = [self.prompt.render(d.text, d.answer_prefix) for d in drafts]
        batch = getattr(self.tokenizer, "encode_batch", None)
        ids = batch(texts) if batch is not None and len(texts) > 1 else [
            self.tokenizer.encode(t) for t in texts]
        return [(text, list(tokens)) for text, tokens in zip(texts, ids)]

    def too_short(self, spec: TaskSpec, length: int, tokens: int) -> UserError:
        need = tokens + spec.tokens_to_generate
        hint = ""
        if isinstance(spec, CommonWordsSpec) and self.word_tokenizer is None:
            hint = " (words from the tokenizer's vocabulary, vocab_words=True, take fewer tokens)"
        return UserError(f"RULER task {spec.name} does not fit in length {length}: its shortest "
                         f"prompt is {tokens} tokens plus {spec.tokens_to_generate} to generate, "
                         f"so its minimum length is {need}{hint}")

    def minimum(self, spec: TaskSpec, length: int) -> int:
        """The task's shortest prompt (the probe's, at its smallest size) + tokens_to_generate."""
        floor = spec.min_size(length)
        draft = self.draft(spec, probe_rng(self.seed, spec.name, length), floor, length, 0)
        return len(self.encode_draft(draft)[1]) + spec.tokens_to_generate

    def fitted(self, spec: TaskSpec, length: int) -> Fitted:
        """The haystack size for (spec, length), searched on the probe prompt; cached."""
        self.fit_all([(spec, length)])
        return self.cache[self._fit_key(spec, length)]

    def _fit_key(self, spec: TaskSpec, length: int) -> tuple:
        return ("fit", spec, length, self.prompt.key, self.seed, self._tokenizer_key)

    def fit_all(self, pairs: list[tuple[TaskSpec, int]]) -> None:
        """`fitted` for every (spec, length) not cached yet, their searches in lockstep: the
        smallest size (over the budget: `too_short`), a probe size for tokens per unit, then
        `fitting_search`."""
        todo = [p for p in dict.fromkeys(pairs) if self._fit_key(*p) not in self.cache]
        if not todo:
            return

        def probe(i: int, size: int) -> Draft:
            spec, length = todo[i]
            return self.draft(spec, probe_rng(self.seed, spec.name, length), size, length, 0)

        def counts(asked: list[tuple[int, int]]) -> list[int]:
            return [len(ids) for _, ids in self.encode_drafts([probe(i, n) for i, n in asked])]

        first = counts([(i, spec.min_size(length) + extra) for i, (spec, length) in
                        enumerate(todo) for extra in (0, spec.probe_size)])
        searches, rates = [], []
        for i, (spec, length) in enumerate(todo):
            base, probed = first[2 * i], first[2 * i + 1]
            budget, floor = length - spec.tokens_to_generate, spec.min_size(length)
            if base > budget:
                raise self.too_short(spec, length, base)
            per_unit = max(1e-3, (probed - base) / spec.probe_size)
            rates.append(per_unit)
            searches.append(fitting_search(budget, floor + int((budget - base) / per_unit),
                                           per_unit, floor, tolerance=math.ceil(per_unit)))
        for pair, found, per_unit in zip(todo, run_searches(searches, counts), rates):
            self.cache[self._fit_key(*pair)] = Fitted(found[0], per_unit)

    def sample(self, spec: TaskSpec, length: int, index: int) -> Sample:
        """Sample `index` of `spec` at `length`: the fitted size, adjusted for this prompt."""
        return self.samples([(spec, length, index)])[0]

    def samples(self, items: list[tuple[TaskSpec, int, int]],
                done: Callable[[int], None] | None = None) -> list[Sample]:
        """`sample` for every (spec, length, index), their searches in lockstep (prompts
        encoded together): the same samples as one by one. `done(i)` as item i is final."""
        self.fit_all([(spec, length) for spec, length, _ in items])
        searches = []
        for spec, length, _ in items:
            fitted = self.fitted(spec, length)
            budget = length - spec.tokens_to_generate
            slack = max(math.ceil(fitted.per_unit), int(SAMPLE_SLACK * budget))
            searches.append(fitting_search(budget, fitted.size, fitted.per_unit,
                                           spec.min_size(length), slack))
        kept: dict[int, tuple[int, Draft, str, list[int]]] = {}  # the largest fitting so far

        def counts(asked: list[tuple[int, int]]) -> list[int]:
            drafts = []
            for i, size in asked:
                spec, length, index = items[i]
                rng = sample_rng(self.seed, spec.name, length, index)
                drafts.append(self.draft(spec, rng, size, length, index))
            encoded = self.encode_drafts(drafts)
            for (i, size), draft, (text, ids) in zip(asked, drafts, encoded):
                spec, length, _ = items[i]
                if len(ids) <= length - spec.tokens_to_generate and size > kept.get(i, (-1,))[0]:
                    kept[i] = (size, draft, text, ids)
            return [len(ids) for _, ids in encoded]

        out = []
        for i, found in enumerate(run_searches(searches, counts, done)):
            spec, length, index = items[i]
            if found is None:
                floor = spec.min_size(length)
                rng = sample_rng(self.seed, spec.name, length, index)
                raise self.too_short(spec, length, len(self.encode_draft(
                    self.draft(spec, rng, floor, length, index))[1]))
            size, draft, text, ids = kept[i]
            assert size == found[0], (size, found)  # the search's answer is the largest fitting
            out.append(Sample(task=spec.name, length=length, index=index, input=text,
                              answer_prefix=draft.answer_prefix, prompt_ids=ids,
                              references=list(draft.references),
                              max_new_tokens=spec.tokens_to_generate, metric=spec.metric))
        return out
