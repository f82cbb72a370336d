"""RULER-style tasks (trainer/evals/ruler): each generator's prompt holds what its references
say (needles, chains, word counts), prompts fit their length, and samples are deterministic per
(seed, task, length, index). Byte-level tokenizer, and a small BPE trained here (no download)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from trainer.data.tokenizer import ByteTokenizer, JsonTokenizer
from trainer.errors import UserError
from trainer.evals.ruler import REGISTRY, build_samples, select_tasks, word_pool
from trainer.evals.ruler.fit import largest_fitting
from trainer.evals.ruler.haystack import EssayText, insert_at_depths, split_sentences
from trainer.evals.ruler.templates import NOISE
from trainer.evals.ruler.words import random_numbers, random_uuids

ESSAY = " ".join(
    f"Sentence {i} tells of the {w} river and the old {v} town. Was it far? It was near!"
    for i, (w, v) in enumerate(zip(["quiet", "wide", "cold", "slow"] * 40,
                                   ["stone", "harbor", "market", "mill"] * 40)))
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYNTHETIC = [n for n in REGISTRY if not n.startswith("qa_")]
NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


def train_bpe(directory: Path) -> JsonTokenizer:
    """A byte-level BPE (~700 tokens) trained on a few KB of text, chat markers as specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [ESSAY, NOISE * 3, "One of the special magic numbers for key is: 1234567. " * 5,
            "house garden window river mountain letter number question answer " * 5]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return JsonTokenizer(directory / "tokenizer.json")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> JsonTokenizer:
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def one(name: str, length: int, tokenizer=None, index: int = 0, seed: int = 0, **kw):
    specs = [REGISTRY[name]]
    return build_samples(specs, [length], index + 1, tokenizer or ByteTokenizer(), seed=seed,
                         text_source=ESSAY, progress=False, **kw)[index]


def test_the_registry_is_rulers_thirteen_tasks() -> None:
    assert list(REGISTRY) == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
        "qa_2"]
    assert REGISTRY["niah_multikey_3"].key_type == REGISTRY["niah_multikey_3"].value_type \
        == "uuids"
    assert (REGISTRY["vt"].num_chains, REGISTRY["vt"].num_hops) == (1, 4)
    assert (REGISTRY["cwe"].freq_cw, REGISTRY["cwe"].freq_ucw, REGISTRY["cwe"].num_cw) \
        == (30, 3, 10)
    assert REGISTRY["fwe"].alpha == 2.0
    assert [REGISTRY[n].tokens_to_generate for n in ("niah_single_1", "vt", "cwe", "fwe")] \
        == [128, 30, 120, 50]


def test_word_pool_is_distinct_seeded_and_pronounceable(bpe) -> None:
    words = word_pool(np.random.default_rng(1), 500)
    assert len(set(words)) == 500
    assert all(re.fullmatch(r"[a-z]{5,9}", w) for w in words)
    assert words == word_pool(np.random.default_rng(1), 500)
    assert words != word_pool(np.random.default_rng(2), 500)
    assert word_pool(np.random.default_rng(1), 500, ByteTokenizer()) == words  # no vocab
    vocab = word_pool(np.random.default_rng(1), 5, bpe)  # the BPE's own whole-word tokens
    assert all(bpe.decode(bpe.encode(" " + w)) == " " + w and len(bpe.encode(" " + w)) == 1
               for w in vocab)
    many = word_pool(np.random.default_rng(1), 2000, bpe)  # more than it has: topped up
    assert len(set(many)) == 2000 and all(w.isalpha() and w.islower() for w in many)
    rng = np.random.default_rng(0)
    assert all(re.fullmatch(r"[1-9]\d{6}", n) for n in random_numbers(rng, 200))
    assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                            u) for u in random_uuids(rng, 50))


def test_haystack_pieces() -> None:
    assert split_sentences("One. Two? Three!  Four") == ["One.", "Two?", "Three!", "Four"]
    code = " ".join(f"x{i} = f(y)" for i in range(100))  # no sentence ends: cut every 64 words
    assert [len(p.split()) for p in split_sentences(code)] == [64, 64, 64, 64, 44]
    essay = EssayText(["a b c", "d e"])
    taken = essay.take(np.random.default_rng(0), 12)  # wraps around the 5 words
    assert len(taken.split()) == 12 and set(taken.split()) == set("abcde")
    sentences = [f"S{i}." for i in range(100)]
    text = insert_at_depths(np.random.default_rng(0), sentences, ["N1", "N2", "N3"])
    parts = text.split(" ")
    assert [p for p in parts if p.startswith("N")] == ["N1", "N2", "N3"]
    assert [p for p in parts if p.startswith("S")] == sentences
    with pytest.raises(UserError, match="empty"):
        EssayText("  \n ")


def _needles(prompt: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for _, key, value in NEEDLE.findall(prompt):
        found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("name", [n for n in SYNTHETIC if n.startswith("niah")])
def test_niah_prompts_hold_the_asked_values_once(name: str) -> None:
    spec = REGISTRY[name]
    s = one(name, 3000)
    question = s.input[s.input.rindex("\nWhat "):]
    needles = _needles(s.input)
    asked = sorted((k for k in needles if k in question), key=question.index)
    assert len(asked) == spec.num_queries
    assert sorted(s.references) == sorted(v for k in asked for v in needles[k])
    if spec.num_values == 1:
        assert s.references == [needles[k][0] for k in asked]  # in the question's order
    for value in s.references:
        assert s.input.count(value) == 1  # one needle holds it; no distractor repeats it
    assert all(len(needles[k]) == spec.num_values for k in asked)
    hidden = [k for k in needles if len(needles[k]) == spec.num_values and k not in asked]
    if spec.haystack == "needle":
        assert len(needles) > 20  # the haystack is distractor needles
    else:
        assert len(needles) == max(spec.num_keys, spec.num_queries)
        assert len(hidden) == len(needles) - len(asked)
    if spec.haystack == "noise":
        assert s.input.count(NOISE) > 10
    if spec.haystack == "essay":
        assert "river" in s.input
    value_kind = "uuid" if spec.value_type == "uuids" else "number"
    if spec.num_queries * spec.num_values == 1:
        assert s.input.startswith(f"A special magic {value_kind} is hidden")
        assert s.input.endswith(f"The special magic {value_kind} for {asked[0]} mentioned in the "
                                "provided text is")
    else:
        assert s.input.startswith(f"Some special magic {value_kind}s are hidden")
        assert s.input.endswith(" mentioned in the provided text are")
    if spec.key_type == "words":
        assert all(re.fullmatch(r"[a-z]{5,9}-[a-z]{5,9}", k) for k in asked)


def test_vt_chain_leads_from_the_value_through_the_references() -> None:
    s = one("vt", 3000)
    example, task = s.input.split("\n\nMemorize and track", 1)
    assert example.startswith("Memorize and track") and " they are:  " in example
    value = re.search(r"assigned the value (\d{5}) in the text above", task).group(1)
    assign = dict(re.findall(r"^VAR ([A-Z]{5}) = VAR ([A-Z]{5}) ?$", task, re.M))
    start = re.findall(rf"^VAR ([A-Z]{{5}}) = {value}$", task, re.M)
    chain = start[:]
    while (nxt := [a for a, b in assign.items() if b == chain[-1]]):
        chain += nxt
    assert chain == s.references and len(chain) == 5
    assert task.count(NOISE) > 5 and "5 variables are assigned the value" in s.input
    # the example's answer follows its chain too
    answer = example.rsplit("they are:  ", 1)[1].split()
    assert len(answer) == 5 and all(re.fullmatch(r"[A-Z]{3}", a) for a in answer)
    assert f"VAR {answer[1]} = VAR {answer[0]}" in example


@pytest.mark.parametrize("length, common, rare", [(3000, 6, 1), (9000, 30, 3)])
def test_cwe_common_words_are_the_references(length: int, common: int, rare: int) -> None:
    s = one("cwe", length)
    listing = s.input.rsplit("Memorize the ones that appear most often.\n", 1)[1]
    listing = listing.split("\nQuestion:")[0]
    numbers, words = zip(*re.findall(r"(\d+)\. ([a-z]+)", listing))
    assert [int(n) for n in numbers] == list(range(1, len(numbers) + 1))
    counts = Counter(words)
    assert sorted(w for w, c in counts.items() if c == common) == sorted(s.references)
    assert len(s.references) == 10 and set(counts.values()) == {common, rare}
    assert s.input.count("Question: What are the 10 most common words in the above list?") == 2
    example = s.input.split("\nBelow is a numbered list")[0]
    assert not set(s.references) & set(re.findall(r"[a-z]+", example.split("\n", 1)[1]))


def test_fwe_references_are_the_three_most_frequent_words() -> None:
    s = one("fwe", 3000)
    coded = s.input.split("three most frequently appeared coded words. ")[1].split("\n")[0]
    counts = Counter(coded.split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.references
    assert counts[ranked[3]] > counts[ranked[4]]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.references)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_prompts_fill_their_length(name: str, bpe) -> None:
    """tokens + tokens_to_generate <= length, within a few percent of it (byte and BPE)."""
    # pseudo-words cost this small BPE many tokens: cwe's 300 common entries need 8K
    for tokenizer, length in ((ByteTokenizer(), 9000), (bpe, 8192 if name == "cwe" else 4096)):
        samples = build_samples([REGISTRY[name]], [length], 2, tokenizer, text_source=ESSAY,
                                progress=False)
        for s in samples:
            used = len(s.prompt_ids) + s.max_new_tokens
            assert used <= length and used >= 0.97 * length, (tokenizer.name, used)
            assert s.prompt_ids == tokenizer.encode(s.input)


def test_samples_depend_on_seed_task_length_and_index_alone() -> None:
    specs = select_tasks(["niah_single_2", "vt", "fwe"])
    alone = build_samples(specs[1:2], [2500], 3, ByteTokenizer(), seed=5, text_source=ESSAY,
                          progress=False)
    mixed = build_samples(specs, [1800, 2500], 4, ByteTokenizer(), seed=5, text_source=ESSAY,
                          progress=False)
    vt_2500 = [s for s in mixed if s.task == "vt" and s.length == 2500]
    assert [s.input for s in vt_2500[:3]] == [s.input for s in alone]
    assert len({s.input for s in vt_2500}) == 4  # different indices differ
    other_seed = build_samples(specs[1:2], [2500], 1, ByteTokenizer(), seed=6,
                               text_source=ESSAY, progress=False)
    assert other_seed[0].input != alone[0].input


def test_too_short_lengths_and_missing_text_are_user_errors() -> None:
    with pytest.raises(UserError, match=r"vt does not fit in length 300.*minimum length is \d+"):
        one("vt", 300)
    with pytest.raises(UserError, match="text_source"):
        build_samples([REGISTRY["niah_single_2"]], [2000], 1, ByteTokenizer(), progress=False)
    build_samples([REGISTRY["niah_single_1"]], [2000], 1, ByteTokenizer(), progress=False)


def test_largest_fitting_finds_the_boundary() -> None:
    calls = []

    def measure(size: int):
        calls.append(size)
        return 10 + 7 * size + (size % 3), None  # roughly linear, a little ragged

    size, tokens, _ = largest_fitting(measure, 1000, start=20, per_unit=3.0)
    assert tokens <= 1000 and 10 + 7 * (size + 1) + (size + 1) % 3 > 1000
    assert len(calls) < 15
    assert largest_fitting(lambda n: (50 + n, None), 40, start=5, per_unit=1.0) is None


class OneAtATime:
    """A tokenizer with `encode` only (no `encode_batch`), counting its calls."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0
        self.vocab_size, self.eod, self.name = inner.vocab_size, inner.eod, inner.name

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return self.inner.encode(text)

    def decode(self, ids) -> str:
        return self.inner.decode(ids)


def test_samples_built_together_equal_samples_built_one_by_one(bpe: JsonTokenizer,
                                                              monkeypatch) -> None:
    """Every sample's fit is searched in lockstep with the others' (their prompts encoded in
    batches): the prompts are the ones a search of its own finds, batch or no batch."""
    from trainer.evals.ruler.fit import Context
    from trainer.evals.ruler.templates import PromptFormat

    specs = select_tasks(["niah_single_2", "niah_multikey_1", "vt", "fwe"], None)
    items = [(spec, length, index) for spec in specs for length in (1500, 2500)
             for index in range(3)]
    batches = []
    encode_batch = JsonTokenizer.encode_batch
    monkeypatch.setattr(JsonTokenizer, "encode_batch",
                        lambda self, texts: batches.append(len(texts)) or encode_batch(self, texts))
    together = Context(bpe, 4, PromptFormat("base"), ESSAY).samples(items)
    plain = OneAtATime(bpe)
    alone = [Context(plain, 4, PromptFormat("base"), ESSAY).sample(*item) for item in items]
    assert [(s.task, s.length, s.index, s.input, s.prompt_ids) for s in together] == [
        (s.task, s.length, s.index, s.input, s.prompt_ids) for s in alone]
    assert max(batches) >= len(items) and plain.calls > len(items)  # batched vs one by one
    assert all(len(s.prompt_ids) + s.max_new_tokens <= s.length for s in together)
