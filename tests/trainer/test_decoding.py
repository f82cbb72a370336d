"""Retrieval grading (trainer/evals/decoding.py: greedy decoding on the engine for the trainer's
model, recomputation of every step for other models) against a reference grading written here:
the same verdict for every trial, whatever the tokenizer splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.gpt import build_gpt, transformer_config
from tests.conftest import compose_config
from tests.trainer.scripted import (
    Counting,
    ScriptedModel,
    asked_and_others,
    follow,
    greedy_continue,
    noisy_script,
)
from trainer.data.tokenizer import ByteTokenizer, JsonTokenizer
from trainer.evals.decoding import Greedy
from trainer.evals.measures import passkey_accuracy
from trainer.evals.passkey import FILLER, QUESTION, answer_text, passkey_prompt, random_key
from trainer.evals.retrieval import NAMES, multikey_accuracy, multikey_prompt

CPU = torch.device("cpu")
WORDS = "river stone lamp orchard window thunder paper copper meadow lantern".split()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> JsonTokenizer:
    """A byte-level BPE whose merges join digits, so a key has several token splits."""
    rng = np.random.default_rng(0)
    texts = [FILLER, QUESTION, " ".join(WORDS), " ".join(NAMES)] * 20
    texts += [f"The pass key for {n} is {k}. Remember it. {k} is the pass key."
              for n, k in zip(rng.choice(NAMES, 400), rng.integers(10_000, 100_000, 400))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = Path(tmp_path_factory.mktemp("bpe")) / "tokenizer.json"
    tok.save(str(path))
    return JsonTokenizer(path)


def splits(tokenizer):
    """Token splits of a digit string: the tokenizer's own, per digit, and cut after 2."""
    def of(text: str) -> list[list[int]]:
        out = [tokenizer.encode(text), [t for d in text for t in tokenizer.encode(d)],
               tokenizer.encode(text[:2]) + tokenizer.encode(text[2:])]
        return [s for i, s in enumerate(out) if s not in out[:i]]
    return of


def stream(tokenizer) -> np.ndarray:
    rng = np.random.default_rng(0)
    docs = [tokenizer.encode(" ".join(rng.choice(WORDS, 40)) + ".") + [tokenizer.eod]
            for _ in range(40)]
    return np.concatenate(docs)


def old_passkey(model, tokenizer, lengths, depths, trials, digits, batch_size, seed):
    """The reference grading: greedy decoding of as many tokens as the key has
    digits, compared as text."""
    rng = np.random.default_rng(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            correct = 0
            for start in range(0, trials, batch_size):
                keys = [random_key(rng, digits) for _ in range(min(batch_size, trials - start))]
                pairs = [passkey_prompt(tokenizer, length, depth, key) for key in keys]
                out = greedy_continue(model, torch.tensor([p for p, _ in pairs]),
                                      max(len(answer_text(k)) for k in keys),
                                      tokenizer.vocab_size)
                correct += sum(tokenizer.decode(row).startswith(tokenizer.decode(a))
                               for row, (_, a) in zip(out.tolist(), pairs))
            cells.append(correct)
    return cells


def old_multikey(model, tokenizer, data, lengths, depths, trials, keys, digits, batch_size,
                 seed):
    """The reference multi-key grading: (correct, distractor) per cell."""
    cells = []
    for length in lengths:
        for j, depth in enumerate(depths):
            built = [multikey_prompt(tokenizer, data, length, depth, keys, digits,
                                     np.random.default_rng((seed, 0x4E1D, length, j, t)))
                     for t in range(trials)]
            correct = distractor = 0
            for start in range(0, trials, batch_size):
                batch = built[start:start + batch_size]
                steps = max(len(answer_text(v)) for t in batch for v in t.values)
                out = greedy_continue(model, torch.tensor([t.prompt for t in batch]), steps,
                                      tokenizer.vocab_size)
                for trial, row in zip(batch, out.tolist()):
                    text = tokenizer.decode(row)
                    correct += text.startswith(answer_text(trial.values[0]))
                    distractor += any(text.startswith(answer_text(v)) for v in trial.values[1:])
            cells.append((correct, distractor))
    return cells


def tokenizer_of(name: str, bpe: JsonTokenizer):
    return {"bytes": ByteTokenizer(), "bpe": bpe}[name]


@pytest.mark.parametrize("name", ["bytes", "bpe"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_passkey_grading_is_greedys_over_random_models(bpe, name: str, seed: int) -> None:
    tok = tokenizer_of(name, bpe)
    model = ScriptedModel(tok, noisy_script(tok, seed, splits(tok)), tok.vocab_size)
    old, new = Counting(model), Counting(model)
    args = dict(lengths=[160, 200], depths=[0.0, 1.0], trials=12, digits=5, batch_size=4,
                seed=seed)
    cells = passkey_accuracy(new, tok, device=CPU, **args)
    assert [c.correct for c in cells] == old_passkey(old, tok, **args)
    assert 0 < sum(c.correct for c in cells) < sum(c.trials for c in cells)  # both verdicts


@pytest.mark.parametrize("name", ["bytes", "bpe"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multikey_grading_is_greedys_over_random_models(bpe, name: str, seed: int) -> None:
    tok = tokenizer_of(name, bpe)
    model = ScriptedModel(tok, noisy_script(tok, seed, splits(tok)), tok.vocab_size)
    old, new = Counting(model), Counting(model)
    args = dict(lengths=[500], depths=[0.0, 0.5, 1.0], trials=10, keys=3, digits=5,
                batch_size=4, seed=seed)
    cells = multikey_accuracy(new, tok, stream(tok), device=CPU, **args)
    expected = old_multikey(old, tok, stream(tok), **args)
    assert [(c.correct, c.distractor) for c in cells] == expected
    assert sum(c for c, _ in expected) > 0 and sum(d for _, d in expected) > 0


def fixed(tok, pick) -> ScriptedModel:
    """A model that answers pick(asked, others) -> token ids, then eod."""
    def script(prompt: str, answer: list[int]) -> int:
        return follow(pick(*asked_and_others(prompt)), answer, tok.eod)
    return ScriptedModel(tok, script, tok.vocab_size)


def test_an_oracle_passes_every_trial(bpe) -> None:
    tok = bpe
    oracle = fixed(tok, lambda asked, others: tok.encode(asked))
    cells = passkey_accuracy(oracle, tok, [200], [0.5], trials=8, digits=5, batch_size=4,
                             seed=0, device=CPU)
    assert cells[0].correct == 8
    lengths = {len(tok.encode(answer_text(random_key(np.random.default_rng(s), 5))))
               for s in range(50)}
    assert len(lengths) > 1  # keys of several token counts in one batch


@pytest.mark.parametrize(("pick", "correct", "distractor"), [
    ("asked_cut", 6, 0), ("other", 0, 6), ("other_cut", 0, 6), ("partial", 0, 0),
    ("asked_prefix", 0, 0), ("asked_per_digit", 6, 0), ("other_per_digit", 0, 6)])
def test_adversarial_answers(bpe, pick: str, correct: int, distractor: int) -> None:
    """Another split of the asked key (passes), a distractor's value in either split (counted
    apart), a correct start with a wrong digit, the key's first digits only (fail). One digit
    per token is the longest split: greedy is given that many tokens, so it passes (it failed
    when the budget was the longest canonical encoding in the batch)."""
    tok = bpe
    per_digit = lambda v: [t for d in v for t in tok.encode(d)]  # noqa: E731
    answer = {"asked_per_digit": lambda a, o: per_digit(a),
              "asked_cut": lambda a, o: tok.encode(a[:3]) + tok.encode(a[3:]),
              "other": lambda a, o: tok.encode(o[0]),
              "other_cut": lambda a, o: tok.encode(o[0][:3]) + tok.encode(o[0][3:]),
              "other_per_digit": lambda a, o: per_digit(o[0]),
              "partial": lambda a, o: tok.encode(a[:3] + str(9 - int(a[3])) + a[4:]),
              "asked_prefix": lambda a, o: per_digit(a[:4])}[pick]
    model = fixed(tok, answer)
    args = dict(lengths=[500], depths=[0.0, 1.0], trials=3, keys=3, digits=5, batch_size=2,
                seed=0)
    cells = multikey_accuracy(model, tok, stream(tok), device=CPU, **args)
    got = [(c.correct, c.distractor) for c in cells]
    assert got == old_multikey(model, tok, stream(tok), **args)
    assert (sum(c for c, _ in got), sum(d for _, d in got)) == (correct, distractor)


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_the_answer_is_the_needles_own_tokens(bpe) -> None:
    """With a BPE tokenizer the expected answer is the token sequence the needle holds (a
    question ending in "is " asked for the digits re-split after a lone space, which a small
    model did not learn to produce), for the passkey and the multi-key asked value."""
    rng = np.random.default_rng(0)
    for t in range(40):
        key = random_key(rng, 5)
        prompt, answer = passkey_prompt(bpe, 300, 0.5, key)
        assert contains(prompt[:-len(bpe.encode(QUESTION))], answer), key
        assert bpe.decode(answer) == answer_text(key) == " " + key
        m = multikey_prompt(bpe, stream(bpe), 500, 0.5, 3, 5, np.random.default_rng(t))
        needle = m.prompt[m.starts[0]:m.starts[0] + 30]
        assert contains(needle, bpe.encode(answer_text(m.values[0])))
    assert not contains(passkey_prompt(bpe, 300, 0.5, "71432")[0], bpe.encode("71432"))


def test_the_engine_grades_a_real_dca_model_as_recomputation(single_process) -> None:
    """On a tiny random GPT with DCA: the engine's greedy tokens (what the grading reads) are
    the ones recomputing every step gives."""
    cfg = compose_config(["model.init_std=0.2", "+attention=dca", "attention.dca_chunk_size=16",
                          "attention.dca_local_size=4"])
    torch.manual_seed(0)
    model = build_gpt(transformer_config(cfg.model, cfg.attention), 384, 64).eval()
    prompts = torch.randint(0, 257, (3, 40), generator=torch.Generator().manual_seed(1))
    greedy = Greedy(model, 257, CPU, batch_size=2)
    assert greedy.engine is not None  # the trainer's model decodes on the engine
    assert greedy.continuations(prompts.tolist(), 6) == greedy_continue(model, prompts, 6,
                                                                          257).tolist()
