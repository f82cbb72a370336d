"""Pipeline parallelism against the single-process run: a TP=1 checkpoint resumed at TP2 x PP2
with interleaved virtual stages, and at PP2 x DP2 (all with the distributed optimizer), reproduces
the single process's next losses (a DCA, head-gated model), and so does a chunked model with a
global layer on the second stage at PP2 x CP2 with full recompute; invalid layouts are refused
before any model is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAST, compose_config, train_on_ranks
from trainer.errors import UserError
from trainer.validate import validate_train

# 4 layers (PP 2 x VPP 2), 4 heads and query groups (TP 2), 4 micro-batches of 2 per step.
MODEL = ["model.num_layers=4", "model.num_attention_heads=4", "model.num_query_groups=4",
         "+attention=[dca,head_gate]", "attention.dca_chunk_size=24",
         "attention.dca_local_size=8", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
         # every run's optimizer checkpoint in the same (distributed, reshardable) format
         "parallel.distributed_optimizer=true"]
STEPS = ["trainer.max_steps=3", "trainer.log_interval=1"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A 3-step single-process run that saved after step 1: (its directory, its metrics)."""
    cwd = tmp_path_factory.mktemp("pipeline")
    return cwd, train_on_ranks(FAST + MODEL + STEPS + ["trainer.save_interval=1"], cwd / "single")


def _resume(cwd: Path, name: str, layout: list[str]) -> list[dict]:
    ckpt = cwd / "single" / "checkpoints" / "iter_0000001"
    return train_on_ranks(FAST + MODEL + STEPS + layout + [f"checkpoint.load={ckpt}",
                                                           "checkpoint.save=false"],
                          cwd / name, nproc=4)


def _assert_same_losses(resumed: list[dict], single: list[dict]) -> None:
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(resumed, single[1:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-4)


@pytest.mark.slow
def test_tp2_pp2_interleaved_matches_single_process(single: tuple[Path, list[dict]]) -> None:
    cwd, metrics = single
    resumed = _resume(cwd, "tp2pp2", ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"])
    _assert_same_losses(resumed, metrics)


@pytest.mark.slow
def test_pp2_dp2_distributed_optimizer_matches_single_process(
        single: tuple[Path, list[dict]]) -> None:
    cwd, metrics = single
    resumed = _resume(cwd, "pp2dp2", ["parallel.pp=2"])
    _assert_same_losses(resumed, metrics)


@pytest.mark.parametrize(("overrides", "world", "message"), [
    (["model.num_layers=3", "parallel.pp=2"], 2, "model.num_layers (3) is not divisible"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.vpp=4"], 2, "parallel.pp x parallel.vpp"),
    (["parallel.pp=2", "parallel.tp=2"], 6, "must be a multiple of parallel.tp"),
    (["model.num_layers=4", "parallel.pp=2", "trainer.global_batch_size=4",
      "trainer.micro_batch_size=4"], 4, "micro_batch_size x data-parallel size (4 x 2)"),
    (["parallel.vpp=2"], 1, "needs parallel.pp > 1"),
    (["model.num_attention_heads=4", "model.num_query_groups=2", "parallel.tp=3"], 3,
     "model.num_attention_heads (4) is not divisible by 3; model.num_query_groups (2)"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2", "trainer.global_batch_size=6",
      "trainer.micro_batch_size=2"], 2, "multiple of parallel.pp (2) micro-batches"),
])
def test_invalid_layouts_are_refused(overrides: list[str], world: int, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_train(compose_config(FAST + overrides), world)


def test_valid_layout_passes() -> None:
    validate_train(compose_config(FAST + ["model.num_layers=4", "parallel.pp=2",
                                          "parallel.vpp=2", "parallel.tp=2",
                                          "trainer.global_batch_size=8",
                                          "trainer.micro_batch_size=2"]), 8)
    # TP2 x PP2 on 4 ranks leaves one data-parallel rank: micro 4 fills a batch of 4
    validate_train(compose_config(FAST + ["model.num_layers=4", "parallel.pp=2",
                                          "parallel.tp=2"]), 4)


# Chunked attention whose only global (no-RoPE) layer is layer 4: on stage 2 of PP2 it is the
# stage's second layer, so a stage that numbered its layers from 1 would miss it (without that
# layer the resumed losses differ: 5.747 vs 5.738 at step 2).
CHUNKED = ["model.num_layers=4", "model.num_attention_heads=4", "model.num_query_groups=4",
           "+attention=chunked", "attention.chunk_size=16", "attention.global_layer_interval=4",
           "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
           "parallel.distributed_optimizer=true"]


@pytest.mark.slow
def test_chunked_global_layers_at_pp2_cp2_with_recompute_match_single_process(
        tmp_path: Path) -> None:
    single = train_on_ranks(FAST + CHUNKED + STEPS + ["trainer.save_interval=1"],
                            tmp_path / "single")
    ckpt = tmp_path / "single" / "checkpoints" / "iter_0000001"
    resumed = train_on_ranks(FAST + CHUNKED + STEPS + [
        "parallel.pp=2", "parallel.cp=2", "trainer.recompute=full", f"checkpoint.load={ckpt}",
        "checkpoint.save=false"], tmp_path / "pp2cp2", nproc=4)
    _assert_same_losses(resumed, single)
