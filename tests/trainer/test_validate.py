"""Every setting that can be checked before the model is built is refused up
front, with one line naming the key (trainer/validate.py), and the data checks that need the
corpus run before the model exists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from megatron.core import parallel_state

from ckpt.paths import TRACKER, resolve_checkpoint
from ckpt.reader import CheckpointError
from parallel.distributed import shutdown
from tests.conftest import FAST, compose_config
from trainer.build_data import main as build_main
from trainer.data.datasets import build_datasets
from trainer.errors import UserError
from trainer.init_from import open_load
from trainer.train import Trainer, train
from trainer.validate import check_attention_selection, validate_eval, validate_train


@pytest.mark.parametrize(("override", "key"), [
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
    ("trainer.global_batch_size=0", "trainer.global_batch_size"),
    ("trainer.global_batch_size=-8", "trainer.global_batch_size"),
    ("trainer.log_interval=0", "trainer.log_interval"),
    ("trainer.save_interval=-1", "trainer.save_interval"),
    ("trainer.eval_interval=-5", "trainer.eval_interval"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("model.num_layers=0", "model.num_layers"),
    ("model.num_query_groups=3", "model.num_query_groups"),  # 4 heads
    ("trainer.seq_length=63", "trainer.seq_length"),  # with parallel.cp=2 below
    ("checkpoint.load=/no/such/checkpoints", "checkpoint.load"),
    ("data.valid_fraction=1.5", "data.valid_fraction"),
    ("trainer.dca_cuda_graphs=true", "trainer.dca_cuda_graphs"),  # attention is standard
    ("trainer.dca_backward=parts", "trainer.dca_backward=parts picks DCA's"),  # standard
    ("trainer.dca_keep_rotated=true", "trainer.dca_keep_rotated=true keeps DCA's"),  # standard
    ("+attention=dca", "dca_chunk_size"),  # 8192 > 1024 local by default; set local too big
])
def test_bad_setting_is_refused_before_the_model_is_built(
        override: str, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {"trainer.seq_length=63": ["parallel.cp=2"],
             "+attention=dca": ["attention.dca_local_size=9000"]}.get(override, [])
    cfg = compose_config(FAST + [override] + extra)
    # Nothing past the checks may run: building data or the model would be the late failure.
    monkeypatch.setattr(Trainer, "_setup_parallel", _must_not_run)
    monkeypatch.setattr(Trainer, "_setup_model", _must_not_run)
    with pytest.raises(UserError) as info:
        Trainer(cfg, tmp_path)
    assert key in str(info.value) and "\n" not in str(info.value)


def _must_not_run(*args: object) -> None:
    raise AssertionError("reached past the up-front checks")


def test_good_settings_pass_including_odd_seq_length_without_cp() -> None:
    validate_train(compose_config(FAST))
    # Parity matters only to context parallelism's 2 x cp pieces; without CP any length trains.
    validate_train(compose_config(FAST + ["trainer.seq_length=63"]))
    validate_train(compose_config(FAST + ["trainer.seq_length=64", "parallel.cp=2"]), 2)


@pytest.mark.parametrize("overrides", [
    ["+attention=[dca,chunked]"], ["+attention=[standard,dca]"], ["++attention=[chunked,dca]"],
])
def test_two_core_attention_kinds_are_refused(overrides: list[str]) -> None:
    with pytest.raises(UserError, match="two core-attention kinds"):
        check_attention_selection(overrides)


def test_one_attention_kind_with_the_gate_is_fine() -> None:
    check_attention_selection(["+attention=[dca,head_gate]", "attention.chunk_size=64"])
    check_attention_selection(["+attention=chunked", "trainer.max_steps=3"])


def test_empty_validation_set_is_refused_when_the_run_evaluates(tmp_path: Path) -> None:
    """The refusal comes after the process group is up (the data is read then); `train` tears
    the groups down, so the next run in this process starts clean."""
    cfg = compose_config(FAST + ["data.valid_fraction=0", "trainer.eval_interval=2",
                                 "data.max_documents=30"])
    try:
        with pytest.raises(UserError, match="trainer.eval_interval=0"):
            train(cfg, tmp_path)
        assert not dist.is_initialized()
        assert not parallel_state.model_parallel_is_initialized()
    finally:
        shutdown()


def test_garbage_tracker_is_named(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("garbage\n")
    with pytest.raises(CheckpointError, match=f"{TRACKER}.*'garbage'"):
        resolve_checkpoint(tmp_path)
    cfg = compose_config(FAST + [f"checkpoint.load={tmp_path}"])
    with pytest.raises(UserError, match=f"checkpoint.load=.*{TRACKER}"):
        open_load(cfg.checkpoint.load)  # the trainer's first look at the checkpoint
    with pytest.raises(UserError, match=f"checkpoint.load=.*{TRACKER}"):
        train(cfg, tmp_path / "run")


def test_eval_layouts_are_judged_by_what_eval_runs(tmp_path: Path) -> None:
    """trainer.eval runs at TP alone: a pipeline layout is refused for that reason, not with a
    made-up layer count (it once said `model.num_layers (2)` for any model)."""
    cfg = compose_config(FAST + ["model=gpt_125m", "parallel.pp=4",
                                 f"checkpoint.load={tmp_path}"])
    with pytest.raises(UserError, match=r"trainer.eval runs .* parallel.pp=4") as err:
        validate_eval(cfg)
    assert "num_layers" not in str(err.value)
    cfg = compose_config(FAST + ["parallel.tp=3", f"checkpoint.load={tmp_path}"])
    with pytest.raises(UserError, match=r"number of processes \(1\) must be a multiple"):
        validate_eval(cfg)


def test_empty_inputs_build_no_dataset(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("")
    assert build_main([str(tmp_path / "empty.txt"), "--output-prefix", str(tmp_path / "ds")]) == 2
    assert "no documents" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_empty_indexed_dataset_is_refused_on_load(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "empty")  # as megatron's own tools would write one
    IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16).finalize(prefix + ".idx")
    with pytest.raises(UserError, match="empty"):
        build_datasets("indexed", prefix, "byte", 8, 0.05, seed=0)
