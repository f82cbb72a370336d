"""Multi-key retrieval among distractors (trainer/evals/retrieval.py) and perplexity by position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.scripted import ScriptedModel, asked_and_others, follow
from trainer.data.tokenizer import ByteTokenizer
from trainer.evals import retrieval
from trainer.evals.measures import bucket_edges, perplexity_by_length
from trainer.evals.retrieval import multikey_accuracy, multikey_prompt, needle_text, question_text

TOK = ByteTokenizer()
CPU = torch.device("cpu")
# Held-out "corpus": byte documents of varied text separated by eod (256), as the stream holds.
WORDS = "river stone lamp orchard window thunder paper copper meadow lantern".split()
_rng = np.random.default_rng(0)
STREAM = np.concatenate([np.array(TOK.encode(" ".join(_rng.choice(WORDS, 40)) + ".") + [256])
                         for _ in range(60)])


def trial(depth: float, keys: int = 4, length: int = 700, seed: int = 0):
    return multikey_prompt(TOK, STREAM, length, depth, keys, 5, np.random.default_rng(seed))


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_prompt_places_the_asked_needle_at_depth_among_distinct_distractors(depth: float) -> None:
    t = trial(depth)
    text = TOK.decode(t.prompt)
    assert len(t.prompt) == 700 and text.endswith(question_text(t.names[0]))
    assert len(set(t.names)) == 4 and len(set(t.values)) == 4  # distractors differ from answer
    for name, value, start in zip(t.names, t.values, t.starts):
        needle = TOK.encode(needle_text(name, value))
        assert t.prompt[start:start + len(needle)] == needle
    filler = len(t.prompt) - sum(len(TOK.encode(needle_text(n, v)))
                                 for n, v in zip(t.names, t.values))
    filler -= len(TOK.encode(question_text(t.names[0])))
    before = t.starts[0] - sum(len(TOK.encode(needle_text(n, v)))
                               for n, v, s in zip(t.names, t.values, t.starts) if s < t.starts[0])
    assert abs(before / filler - depth) < 0.01  # filler tokens before the asked needle


def test_filler_is_held_out_text_not_a_repeated_sentence() -> None:
    t = trial(0.5, keys=1)
    filler = [x for i, x in enumerate(t.prompt)
              if not t.starts[0] <= i < t.starts[0] + len(TOK.encode(
                  needle_text(t.names[0], t.values[0])))][:-len(TOK.encode(
                      question_text(t.names[0])))]
    clean = STREAM[STREAM != 256].tolist()
    assert any(clean[i:i + len(filler)] == filler for i in range(len(clean)))  # contiguous
    assert 256 not in filler  # separators out
    assert trial(0.5, keys=1, seed=1).prompt != t.prompt  # another seed, other text


def _answer_with(pick: str) -> ScriptedModel:
    """A model that reads the prompt and answers the asked key or another, then eod."""
    def script(prompt: str, answer: list[int]) -> int:
        asked, others = asked_and_others(prompt)
        return follow(TOK.encode(asked if pick == "asked" else others[0]), answer, TOK.eod)
    return ScriptedModel(TOK, script)


@pytest.mark.parametrize(("pick", "correct", "distractor"), [("asked", 1.0, 0), ("other", 0.0, 3)])
def test_grading(pick: str, correct: float, distractor: int) -> None:
    cells = multikey_accuracy(_answer_with(pick), TOK, STREAM, [500], [0.0, 1.0], trials=3,
                              keys=3, digits=5, batch_size=2, seed=0, device=CPU)
    assert [(c.accuracy, c.distractor, c.trials) for c in cells] == [(correct, distractor, 3)] * 2


def test_cells_depend_only_on_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[list[int]]] = [[], []]

    def record(which: int):
        def grade(self, tokenizer, prompts, candidates, steps, progress=None):
            seen[which] += prompts
            return [[False] * len(c) for c in candidates]
        return grade

    for which, batch in ((0, 1), (1, 3)):
        monkeypatch.setattr(retrieval.Greedy, "starts_with", record(which))
        multikey_accuracy(None, TOK, STREAM, [400, 500], [0.5], trials=3, keys=2, digits=5,
                          batch_size=batch, seed=7, device=CPU)
    assert seen[0] == seen[1] and len(seen[0]) == 6


def _positional_model(tokens: torch.Tensor, positions: torch.Tensor, mask: None) -> torch.Tensor:
    """Logits that depend on token and position, so every bucket's loss differs."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(257, 384, generator=gen)
    return table[tokens] * (1 + positions[..., None] / 50)


def test_position_buckets_merge_to_the_whole_sequence_perplexity() -> None:
    stream = np.random.default_rng(1).integers(0, 257, 2000)
    assert bucket_edges(200, 48) == [0, 48, 96, 192] and bucket_edges(200, None) == [0]
    (point,) = perplexity_by_length(_positional_model, stream, [200], windows=3, batch_size=2,
                                    vocab_size=257, device=CPU, trained_length=48)
    assert [(b.start, b.end, b.tokens) for b in point.buckets] == [
        (0, 48, 144), (48, 96, 144), (96, 192, 288), (192, 200, 24)]
    merged = sum(b.nll * b.tokens for b in point.buckets) / sum(b.tokens for b in point.buckets)
    assert merged == pytest.approx(point.nll, rel=1e-12)
    # Independent: the per-position loss from log_softmax, averaged per bucket.
    windows = torch.tensor(np.stack([stream[i * 200:(i + 1) * 200 + 1] for i in range(3)]))
    logits = _positional_model(windows[:, :-1], torch.arange(200).expand(3, 200), None)[..., :257]
    nll = -logits.double().log_softmax(-1).gather(-1, windows[:, 1:, None])[..., 0]
    assert point.nll == pytest.approx(float(nll.mean()), rel=1e-5)
    for b in point.buckets:
        assert b.nll == pytest.approx(float(nll[:, b.start:b.end].mean()), rel=1e-5)
    assert len({round(b.nll, 3) for b in point.buckets}) == 4
