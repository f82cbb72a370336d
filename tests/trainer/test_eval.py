"""Long-context evaluation: passkey construction and grading, perplexity, the eval entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import compose_config
from tests.trainer.scripted import ScriptedModel, asked_and_others, follow, greedy_continue
from trainer.data.datasets import DataIterator
from trainer.data.tokenizer import ByteTokenizer
from trainer.evals.measures import passkey_accuracy, perplexity_by_length
from trainer.evals.passkey import QUESTION, passkey_prompt
from trainer.evals.retrieval_mix import PasskeyMix

TOK = ByteTokenizer()


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_has_exact_length_and_puts_the_needle_at_depth(depth: float) -> None:
    prompt, answer = passkey_prompt(TOK, 600, depth, "71432")
    text = TOK.decode(prompt)
    assert len(prompt) == 600 and text.endswith(QUESTION) and TOK.decode(answer) == " 71432"
    at = text.index("The pass key is 71432") / (600 - len(QUESTION))
    assert abs(at - depth) < 0.15
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(TOK, 40, depth, "71432")


class _Stream(torch.utils.data.Dataset):
    def __init__(self, size: int = 1000) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.full((129,), 7, dtype=torch.int64)


def _keys(batch: dict[str, torch.Tensor]) -> list[str | None]:
    """The passkey each sample of a micro-batch ends with (None: a corpus sample)."""
    texts = [TOK.decode(row.tolist()) for row in batch["tokens"]]
    return [None if row[0] == 7 else text[-4:] + TOK.decode([int(label[-1])])
            for text, row, label in zip(texts, batch["tokens"], batch["labels"])]


def test_passkey_mix_is_deterministic_per_sample_and_ends_with_the_key() -> None:
    mix, again = PasskeyMix(TOK, 0.5, 128, seed=3), PasskeyMix(TOK, 0.5, 128, seed=3)
    base = torch.full((129,), 7, dtype=torch.int64)
    samples = [mix(g, base) for g in range(200)]
    assert all(s.shape == (129,) for s in samples)
    assert all(torch.equal(mix(g, base), again(g, base)) for g in (0, 57, 199))
    keyed = [TOK.decode(s.tolist()) for s in samples if int(s[0]) != 7]
    assert 70 < len(keyed) < 130  # about half
    for text in keyed:
        key = text[-5:]
        assert key.isdigit() and f"The pass key is {key}." in text
        assert text.endswith(f"The pass key is {key}")  # the question, then the answer


def test_passkey_keys_change_every_epoch_and_resume_exactly() -> None:
    """Over a 10-sample corpus, 4 epochs of training draw ~20 different keys (keyed by the
    dataset index they would repeat 5 keys, which a model memorises); a resumed iterator
    continues the same stream."""
    mix = PasskeyMix(TOK, 0.5, 128, seed=3)
    it = DataIterator(_Stream(10), micro_batch_size=5, seed=1, mix=mix)
    stream = [_keys(next(it)) for _ in range(8)]
    keys = [k for batch in stream for k in batch if k]
    assert len(keys) > 12 and len(set(keys)) == len(keys)
    resumed = DataIterator(_Stream(10), micro_batch_size=5, seed=1, mix=mix, consumed_samples=15)
    assert [_keys(next(resumed)) for _ in range(5)] == stream[3:]


def test_multikey_examples_hide_named_needles_in_the_samples_own_text() -> None:
    """The mix's multi-key examples: the replaced sample's text as filler, `keys` needles, the
    question about one of them and its answer last; seq + 1 tokens; passkey examples unchanged
    when multi-key ones are added (the same draws)."""
    text = TOK.encode("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 30)
    sample = torch.tensor(text[:513], dtype=torch.int64)
    mix = PasskeyMix(TOK, 0.2, 512, seed=3, multikey_fraction=0.5, keys=3)
    only_passkey = PasskeyMix(TOK, 0.2, 512, seed=3)
    kinds = {"passkey": 0, "multikey": 0, "corpus": 0}
    for g in range(60):
        out = mix(g, sample)
        decoded = TOK.decode(out.tolist())
        assert out.shape == (513,)
        if torch.equal(out, sample):
            kinds["corpus"] += 1
            continue
        asked, others = asked_and_others(decoded)
        assert decoded.endswith(asked)  # the answer ends the sample
        if not others:
            kinds["passkey"] += 1
            assert torch.equal(out, only_passkey(g, sample))
            continue
        kinds["multikey"] += 1
        assert len(others) == 2 and "Lorem ipsum" in decoded and "The grass is green" not in decoded
        name = re.findall(r"What is the pass key for (\w+)\?", decoded)[-1]
        assert f"The pass key for {name} is{asked}. Remember it." in decoded
    assert all(n > 5 for n in kinds.values()), kinds
    with pytest.raises(ValueError, match="sum to at most 1"):
        PasskeyMix(TOK, 0.6, 256, seed=3, multikey_fraction=0.5)
    with pytest.raises(ValueError, match="too short for 3 needles"):  # at setup, not mid-run
        PasskeyMix(TOK, 0.2, 256, seed=3, multikey_fraction=0.5, keys=3)


def _oracle() -> ScriptedModel:
    """Answers the passkey it reads in the prompt, then eod: grading must then score 1.0."""
    return ScriptedModel(TOK, lambda prompt, answer: follow(
        TOK.encode(asked_and_others(prompt)[0]), answer, TOK.eod))


def test_grading_scores_an_oracle_perfectly_and_a_constant_model_zero() -> None:
    cells = passkey_accuracy(_oracle(), TOK, [300], [0.0, 1.0], trials=3, digits=5,
                             batch_size=2, seed=0, device=torch.device("cpu"))
    assert [c.accuracy for c in cells] == [1.0, 1.0]
    const = lambda tokens, positions, mask: torch.zeros(*tokens.shape, 384)  # noqa: E731
    out = greedy_continue(const, torch.zeros(2, 10, dtype=torch.long), 3, vocab_size=257)
    assert out.shape == (2, 3) and int(out.max()) == 0


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size() -> None:
    uniform = lambda tokens, positions, mask: torch.zeros(*tokens.shape, 384)  # noqa: E731
    points = perplexity_by_length(uniform, np.arange(1000) % 257, [64, 128], windows=3,
                                  batch_size=2, vocab_size=257, device=torch.device("cpu"))
    assert [p.windows for p in points] == [6, 3]  # 3 windows of the longest length, tiled
    assert all(p.perplexity == pytest.approx(257, rel=1e-5) for p in points)


def test_every_length_predicts_the_same_tokens() -> None:
    """A model that sees no context (logits from the current token alone) scores every length
    alike only if every length is measured on the same text."""
    table = torch.randn(257, 384, generator=torch.Generator().manual_seed(0))
    bigram = lambda tokens, positions, mask: table[tokens]  # noqa: E731
    stream = np.random.default_rng(1).integers(0, 257, 5000)
    points = perplexity_by_length(bigram, stream, [32, 64, 256], windows=4, batch_size=8,
                                  vocab_size=257, device=torch.device("cpu"))
    assert [p.windows for p in points] == [32, 16, 4]
    assert all(p.perplexity == pytest.approx(points[0].perplexity, rel=1e-9) for p in points)


class _NoSweep:
    """HydraConfig outside a Hydra app, as wandb grouping in trainer.eval reads it: no sweep."""

    mode = None


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_eval_switches_attention_and_writes_results(run_training, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import eval as eval_entry

    run_training(["trainer.max_steps=2", "trainer.save_interval=2"])
    monkeypatch.setattr(eval_entry.HydraConfig, "get", staticmethod(lambda: _NoSweep()))
    cfg = compose_config([
        "+attention=dca", "attention.dca_chunk_size=64", "attention.dca_local_size=16",
        "attention.dca_scaling=yarn", "eval.multikey_trials=1", "eval.multikey_keys=2",
        f"checkpoint.load={tmp_path / 'run' / 'checkpoints'}", "eval.lengths=[256,384]",
        "eval.depths=[0.0,1.0]", "eval.passkey_trials=2", "eval.perplexity_windows=1",
        "eval.attention_queries=4", "logger.mode=offline",
    ])
    out = tmp_path / "eval"
    out.mkdir()
    results = eval_entry.evaluate(cfg, out)
    assert results["trained_attention"] == "standard" and results["attention"]["kind"] == "dca"
    assert [(c["length"], c["depth"]) for c in results["passkey"]] == [
        (256, 0.0), (256, 1.0), (384, 0.0), (384, 1.0)]
    assert results["label"] == "dca+yarn(attn_scale=0.1, original_length=64, parts=all)"
    assert [(c["length"], c["trials"], c["keys"]) for c in results["multikey"]] == [
        (256, 1, 2), (256, 1, 2), (384, 1, 2), (384, 1, 2)]
    # run_training's seq_length 64 is the buckets' T: 0..T, T..2T, 2T..
    assert [[(b["start"], b["end"]) for b in p["buckets"]] for p in results["perplexity"]] == [
        [(0, 64), (64, 128), (128, 256)], [(0, 64), (64, 128), (128, 256), (256, 384)]]
    by_distance = results["attention_by_distance"]
    assert [(a["length"], a["edges"], len(a["entropy"])) for a in by_distance] == [
        (256, [0, 64, 128], 2), (384, [0, 64, 128, 256], 2)]
    assert by_distance[0]["rows"] == [128, 170, 213, 255]  # the second half of the window
    assert all(sum(m) == pytest.approx(1.0) for a in by_distance for m in a["mass"])
    assert json.loads((out / "eval.json").read_text()) == results
    seconds = results["seconds"]  # where the time went, each phase of this suite named
    assert {"data", "load", "cache", "passkey", "multikey", "perplexity", "attention",
            "before"} <= set(seconds) and all(v >= 0 for v in seconds.values())
    assert (out / "passkey.png").stat().st_size > 0 and (out / "perplexity.png").is_file()
    assert list((out / "wandb").glob("offline-run-*"))
    tables = list((out / "wandb").glob("offline-run-*/files/media/table/attention/by_distance_*"))
    rows = json.loads(tables[0].read_text())["data"]  # [label, length, layer, entropy, from, mass]
    assert len(rows) == 2 * (3 + 4) and {r[1] for r in rows} == {256, 384}


def test_eval_refuses_a_checkpoint_that_does_not_fit_the_model(run_training,
                                                               tmp_path: Path) -> None:
    from ckpt.load import CheckpointMismatchError
    from trainer import eval as eval_entry

    run_training(["trainer.max_steps=2", "trainer.save_interval=2"])
    cfg = compose_config(["+attention=head_gate", "eval.lengths=[128]", "logger=none",
                          f"checkpoint.load={tmp_path / 'run' / 'checkpoints'}"])
    with pytest.raises(CheckpointMismatchError, match="linear_qkv.weight._gate"):
        eval_entry.evaluate(cfg, tmp_path)


def test_eval_refuses_an_attention_probe_split_over_tp(tmp_path: Path) -> None:
    from trainer import eval as eval_entry

    cfg = compose_config(["eval.lengths=[128]", "logger=none", "parallel.tp=2",
                          "eval.attention_queries=8", f"checkpoint.load={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match=r"eval.attention_queries=8 needs .* parallel.tp=1"):
        eval_entry.evaluate(cfg, tmp_path)


def test_eval_refuses_context_parallelism_before_loading(tmp_path: Path) -> None:
    from trainer import eval as eval_entry

    cfg = compose_config(["eval.lengths=[128]", "logger=none", "parallel.cp=2",
                          f"checkpoint.load={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match=r"parallel.cp=2, .*; run it with parallel.cp=1"):
        eval_entry.evaluate(cfg, tmp_path)
