"""`python -m ckpt import-hf`: tiny transformers models of each family, logits against theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from tests.ckpt import hf_models
from tests.ckpt.hf_models import VOCAB, hf_logits
from tests.ckpt.longctx_models import trainer_logits

hf_imported = hf_models.hf_imported  # the shared fixture
TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))


def our_logits(root: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """Logits of the imported checkpoint, loaded at TP=1 (a TP=2 one reshards on load)."""
    return trainer_logits(root, tokens)


@pytest.mark.parametrize("family, tied, tp", [
    ("llama", False, 1), pytest.param("llama", False, 2, marks=pytest.mark.slow),
    ("qwen2", True, 1), pytest.param("qwen2", False, 2, marks=pytest.mark.slow),  # 2 ranks
    ("mistral", True, 1), ("llama-yarn", True, 1),
])
def test_imported_logits_match_transformers(hf_imported, family: str, tied: bool,
                                            tp: int) -> None:
    hf, root = hf_imported(family, tied, tp)
    meta = Checkpoint(resolve_checkpoint(root)).meta
    assert meta.model_only and meta.layout.tp == tp and meta.hf_source.vocab_size == VOCAB
    assert meta.vocab_size == VOCAB and meta.seed is None and meta.run_config is None
    diff = (our_logits(root) - hf_logits(hf, TOKENS)).abs().max().item()
    assert diff <= 1e-4, diff


def test_the_imported_record_is_read_by_the_ckpt_tools(hf_imported, tmp_path: Path,
                                                       capsys) -> None:
    """The record import-hf saves (no run config: ckpt/meta.py) works for inspect and reshape;
    the trainer, trainer.eval and export-hf read it in tests/trainer/test_init_from.py,
    test_hf_tokenizer.py and tests/ckpt/test_hf_export.py."""
    from ckpt.__main__ import main

    _, root = hf_imported("qwen2", True)
    assert main(["inspect", str(root)]) == 0
    assert main(["reshape", str(root), str(tmp_path / "tp2"), "--target-tp", "2",
                 "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out
