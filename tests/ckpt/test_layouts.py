"""Any-to-any resume: a checkpoint saved at TP2 x PP2 with the distributed optimizer (a
head-gated model) resumes at TP1 x PP1, PP4 and TP4 with model and optimizer state resharded and
the same next-step loss as the run that saved it; `ckpt inspect` shows the saved layout."""

from __future__ import annotations

import pytest

from ckpt.inspect import describe
from ckpt.reader import Checkpoint
from tests.conftest import FAST, train_on_ranks

pytestmark = pytest.mark.slow

# 4 layers, heads and query groups: fits TP 1, 2, 4 and PP 1, 2, 4.
MODEL = FAST + ["model.num_layers=4", "model.num_attention_heads=4", "model.num_query_groups=4",
                "+attention=head_gate", "parallel.distributed_optimizer=true",
                "trainer.max_steps=2", "trainer.log_interval=1"]


def test_tp2_pp2_checkpoint_resumes_at_tp1_pp4_tp4(tmp_path) -> None:
    saved = train_on_ranks(MODEL + ["parallel.tp=2", "parallel.pp=2", "trainer.save_interval=1"],
                           tmp_path / "saved", nproc=4)
    ckpt = tmp_path / "saved" / "checkpoints" / "iter_0000001"
    layout = describe(Checkpoint(ckpt))["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["distributed_optimizer"]) == \
        (2, 2, 1, True)
    resume = MODEL + [f"checkpoint.load={ckpt}", "checkpoint.save=false"]
    for name, layout_args, nproc in [("tp1", [], 1), ("pp4", ["parallel.pp=4"], 4),
                                     ("tp4", ["parallel.tp=4"], 4)]:
        (row,) = train_on_ranks(resume + layout_args, tmp_path / name, nproc=nproc)
        assert row["step"] == 2
        assert row["loss"] == pytest.approx(saved[1]["loss"], rel=1e-5, abs=1e-5), name
        assert row["grad_norm"] == pytest.approx(saved[1]["grad_norm"], rel=1e-4), name
