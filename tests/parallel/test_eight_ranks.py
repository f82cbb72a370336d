"""Eight ranks on one host, as an 8-GPU node runs them, here as gloo processes on the CPU with a
tiny DCA model: TP x CP x DP layouts train the same losses as one process, and a checkpoint
written at TP=2 x CP=2 x DP=2 resumes at one rank and back at eight with the same next-step
losses (model and optimizer state resharded).

Eight processes on a 2-core CI machine take minutes, so these run on request only:
`LONGCTX_EIGHT_RANKS=1 pytest tests/parallel/test_eight_ranks.py` (docs/parallel.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import FAST, train_on_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("LONGCTX_EIGHT_RANKS"),
                       reason="eight processes: set LONGCTX_EIGHT_RANKS=1 to run"),
]

# 4 heads in 4 query groups (TP 4), 128 tokens in 2 x CP pieces, chunks of 32 (DCA's three parts
# at every CP size), one global batch of 2 sequences (DP 2 x 1).
COMMON = FAST + ["+attention=dca", "attention.dca_chunk_size=32", "attention.dca_local_size=8",
                 "model.num_layers=2", "model.num_attention_heads=4",
                 "model.num_query_groups=4", "trainer.seq_length=128",
                 "trainer.global_batch_size=2", "trainer.max_steps=3", "trainer.log_interval=1",
                 "parallel.distributed_optimizer=true"]
LAYOUTS = {"tp2-cp2-dp2": (["parallel.tp=2", "parallel.cp=2", "trainer.micro_batch_size=1"], 8),
           "tp2-cp4": (["parallel.tp=2", "parallel.cp=4", "trainer.micro_batch_size=2"], 8),
           "tp4-cp2": (["parallel.tp=4", "parallel.cp=2", "trainer.micro_batch_size=2"], 8)}


def _losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def test_layouts_of_eight_ranks_train_one_processs_losses(tmp_path: Path) -> None:
    one = train_on_ranks(COMMON + ["trainer.micro_batch_size=2", "checkpoint.save=false"],
                         tmp_path / "one")
    for name, (layout, ranks) in LAYOUTS.items():
        rows = train_on_ranks(COMMON + layout + ["checkpoint.save=false"], tmp_path / name,
                              nproc=ranks)
        assert _losses(rows) == pytest.approx(_losses(one), rel=1e-4, abs=1e-4), name


def test_an_eight_rank_checkpoint_resumes_at_one_rank_and_back(tmp_path: Path) -> None:
    """8 -> 1 -> 8: each resume's next-step loss equals the run it left."""
    layout, ranks = LAYOUTS["tp2-cp2-dp2"]
    eight = train_on_ranks(COMMON + layout + ["trainer.save_interval=2"], tmp_path / "eight",
                           nproc=ranks)
    saved = tmp_path / "eight" / "checkpoints" / "iter_0000002"
    one = train_on_ranks(COMMON + ["trainer.micro_batch_size=2", f"checkpoint.load={saved}",
                                   "trainer.max_steps=4", "trainer.save_interval=1"],
                         tmp_path / "one")
    assert one[0]["step"] == 3
    assert one[0]["loss"] == pytest.approx(eight[2]["loss"], rel=1e-4, abs=1e-4)
    back = train_on_ranks(COMMON + layout + [
        f"checkpoint.load={tmp_path / 'one' / 'checkpoints' / 'iter_0000003'}",
        "trainer.max_steps=4", "checkpoint.save=false"], tmp_path / "back", nproc=ranks)
    assert [r["step"] for r in back] == [4]
    assert back[0]["loss"] == pytest.approx(one[1]["loss"], rel=1e-4, abs=1e-4)
