"""`trainer.eval` on its defaults runs on any checkpoint the trainer produces (lengths
from the trained length, tasks that do not fit a length skipped with a note), and its perplexity
is over the model's whole vocabulary, as transformers computes the loss."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from tests.ckpt import hf_models
from tests.ckpt.hf_models import VOCAB, hf_logits
from tests.conftest import compose_config
from trainer import eval as eval_entry
from trainer.data.datasets import build_datasets
from trainer.data.tokenizer import load_tokenizer

hf_imported = hf_models.hf_imported  # the shared fixture
QUICK = ["eval.depths=[0.5]", "eval.passkey_trials=1", "eval.multikey_trials=1",
         "eval.perplexity_windows=1", "logger=none"]


@pytest.mark.slow  # end to end, seconds: CI runs it, the quick lane leaves it
def test_defaults_run_on_a_short_trained_checkpoint(tmp_path: Path, run_training,
                                                    caplog) -> None:
    # trained at 64 tokens: four needles and a question do not fit 64 byte tokens
    run_training(["trainer.max_steps=1", "trainer.warmup_steps=0"])
    cfg = compose_config(QUICK + [f"checkpoint.load={tmp_path / 'run' / 'checkpoints'}",
                                  "data.max_documents=60"])
    out = tmp_path / "eval"
    out.mkdir()
    with caplog.at_level(logging.WARNING):
        results = eval_entry.evaluate(cfg, out)
    assert [p["length"] for p in results["perplexity"]] == [64, 128, 256]
    # the passkey prompt needs 96 byte tokens, four needles and the question about 300
    assert {c["length"] for c in results["passkey"]} == {128, 256}
    assert results["multikey"] == []
    notes = sorted(r.message for r in caplog.records if "skipped" in r.message)
    assert [n.split(":")[1] for n in notes] == [" multikey skipped at length 64, 128, 256",
                                                " passkey skipped at length 64"], notes

def test_perplexity_is_transformers_loss_on_the_same_tokens(tmp_path: Path, hf_imported) -> None:
    hf, imported = hf_imported("llama", False)
    tokenizer = load_tokenizer(str(hf))
    assert tokenizer.vocab_size < VOCAB  # the config has ids the tokenizer never produces
    length = 48
    cfg = compose_config(QUICK + [f"checkpoint.load={imported}", f"eval.lengths=[{length}]",
                                  "eval.multikey_trials=0", "data.max_documents=20"])
    out = tmp_path / "eval"
    out.mkdir()
    results = eval_entry.evaluate(cfg, out)
    data = eval_entry.checkpoint_data(cfg, Checkpoint(resolve_checkpoint(imported)).meta)
    _, valid, _ = build_datasets(data.name, data.path, data.tokenizer, length,
                                 data.valid_fraction, 0, data.max_documents)
    tokens = torch.tensor(np.asarray(valid.stream[:length + 1]).astype(np.int64))[None]
    logits = hf_logits(hf, tokens[:, :-1])  # [1, s, VOCAB]
    reference = torch.nn.functional.cross_entropy(logits[0].double(), tokens[0, 1:]).item()
    nll = results["perplexity"][0]["nll"]
    assert math.isclose(nll, reference, rel_tol=1e-4), (nll, reference)
