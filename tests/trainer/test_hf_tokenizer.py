"""A model's own Hugging Face tokenizer (`data.tokenizer=HF_DIR`) for build_data, training and
`trainer.eval`, on an imported tiny model; `trainer.eval` of an imported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from parallel.distributed import shutdown
from tests.ckpt import hf_models
from tests.ckpt.hf_models import VOCAB, save_tokenizer
from tests.conftest import compose_config
from trainer.build_data import build
from trainer.data.tokenizer import load_tokenizer

hf_imported = hf_models.hf_imported  # the shared fixture


@pytest.mark.parametrize("eos, as_dict", [("<|end_of_text|>", False), ("<|endoftext|>", True)])
def test_the_end_of_document_token_is_the_models_own(tmp_path: Path, eos: str,
                                                     as_dict: bool) -> None:
    """Llama 3 names `<|end_of_text|>` (a plain string), Qwen2 `<|endoftext|>` (here as an
    AddedToken dict): the vocabulary is not grown by a token of our own."""
    hf = save_tokenizer(tmp_path, eos, eos_as_dict=as_dict)
    reference = Tokenizer.from_file(str(hf / "tokenizer.json"))
    for spec in (hf, hf / "tokenizer.json"):
        tok = load_tokenizer(str(spec))
        assert tok.eod == reference.token_to_id(eos)
        assert tok.vocab_size == reference.get_vocab_size()


def test_build_data_uses_the_models_tokenizer(tmp_path: Path) -> None:
    hf = save_tokenizer(tmp_path / "hf")
    reference = Tokenizer.from_file(str(hf / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("The grass is green.")
    summary = build([tmp_path / "doc.txt"], str(tmp_path / "data"), tokenizer=str(hf))
    meta = json.loads((tmp_path / "data.meta.json").read_text())
    ids = reference.encode("The grass is green.", add_special_tokens=False).ids
    assert meta["eod"] == reference.token_to_id("<|end_of_text|>")
    assert meta["vocab_size"] == reference.get_vocab_size()
    assert summary["tokens"] == len(ids) + 1


@pytest.mark.slow  # end to end, seconds: CI runs it, the quick lane leaves it
def test_fine_tune_and_eval_with_the_models_tokenizer(tmp_path: Path, run_training,
                                                      hf_imported) -> None:
    """Fine-tune an imported model on its own tokenizer; evaluate the imported checkpoint with
    DCA chosen at eval time (its tokenizer from the checkpoint: import recorded it)."""
    from trainer import eval as eval_entry

    hf, imported = hf_imported("llama", False)
    assert Checkpoint(resolve_checkpoint(imported)).meta.tokenizer == \
        str(hf / "tokenizer.json")  # what trainer.eval below uses
    rows = run_training([f"checkpoint.load={imported}", f"data.tokenizer={hf}",
                         "trainer.max_steps=2", "checkpoint.save=false"], name="ft")
    assert [r["step"] for r in rows] == [1, 2]
    cfg = compose_config([
        f"checkpoint.load={imported}", "+attention=dca", "attention.dca_chunk_size=32",
        "attention.dca_local_size=8", "eval.lengths=[128]", "eval.depths=[0.5]",
        "eval.passkey_trials=2", "eval.perplexity_windows=1", "eval.multikey_trials=0",
        "eval.batch_size=2", "data.max_documents=20", "logger=none"])
    out = tmp_path / "eval"
    out.mkdir()
    results = eval_entry.evaluate(cfg, out)
    assert results["attention"]["kind"] == "dca" and results["trained_attention"] == "standard"
    assert [(c["length"], c["trials"]) for c in results["passkey"]] == [(128, 2)]
    ppl = results["perplexity"][0]["perplexity"]
    # A random model over the real vocabulary: perplexity of the order of the vocabulary size.
    assert VOCAB / 4 < ppl < VOCAB * 4, ppl


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path: Path, run_training,
                                                      hf_imported) -> None:
    _, imported = hf_imported("llama", False)
    text = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    big = save_tokenizer(tmp_path / "big", vocab_size=VOCAB + 50, text=text)
    assert load_tokenizer(str(big)).vocab_size == VOCAB + 50
    try:
        with pytest.raises(ValueError, match=rf"has {VOCAB + 50} tokens; the checkpoint .* has "
                                             rf"a vocabulary of {VOCAB} \(384 rows with padding"):
            run_training([f"checkpoint.load={imported}", f"data.tokenizer={big}",
                          "trainer.max_steps=2"])
    finally:
        shutdown()  # the refusal comes after the process group was made
