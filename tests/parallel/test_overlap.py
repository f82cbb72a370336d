"""Data parallelism with megatron's DDP overlapping its communication (DP=2, gloo on the CPU,
tiny model in buckets of 20000 parameters, so it spans several): the gradient reduction started
bucket by bucket from the backward (`trainer.overlap_grad_reduce`), with and without gradient
accumulation, and with the distributed optimizer's parameter gather in the forward
(`trainer.overlap_param_gather`), trains the losses of the run without overlap and of one
process, and evaluates as the run without the parameter overlap; a checkpoint written under the
parameter overlap holds the step's weights. Settings that cannot apply are refused as one
`error:` line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ckpt.reader import Checkpoint
from tests.conftest import FAST, compose_config, read_metrics, refused_by_trainer_main, spawn
from trainer.errors import UserError
from trainer.validate import validate_train

# 4 steps of 8 sequences: one micro-batch of 4 per DP rank, or two of 2 (gradient accumulation)
COMMON = FAST + ["trainer.max_steps=4", "trainer.global_batch_size=8", "trainer.device=cpu"]
UNSAVED = ["checkpoint.save=false"]
OFF = ["trainer.overlap_grad_reduce=false"]
BUCKETS = ["trainer.overlap_grad_reduce=true", "trainer.ddp_bucket_size=20000"]
ACCUMULATE = ["trainer.micro_batch_size=2"]
PARAM_GATHER = ["parallel.distributed_optimizer=true", "trainer.overlap_param_gather=true"]


def _train_watching_buckets(overrides: list[str], run_dir: str) -> None:
    """Train as `trainer.train` does; rank 0 writes run_dir/in_flight.json: per step, whether
    each DDP bucket's reduction was already under way when the backward ended."""
    import trainer.step
    from trainer.train import train

    in_flight = []
    finalize = trainer.step.finalize_model_grads

    def watching(model: list, *args, **kwargs) -> None:
        in_flight.append([group.grad_reduce_handle is not None
                          for chunk in model for group in chunk.bucket_groups])
        finalize(model, *args, **kwargs)

    trainer.step.finalize_model_grads = watching
    try:
        train(compose_config(overrides), Path(run_dir))
    finally:
        trainer.step.finalize_model_grads = finalize
    if os.environ["RANK"] == "0":  # `train` has left the process group
        (Path(run_dir) / "in_flight.json").write_text(json.dumps(in_flight))


def _train(tmp_path: Path, name: str, overrides: list[str],
           ranks: int = 2) -> tuple[list[dict], list[list[bool]]]:
    """(metrics rows, buckets in flight per step) of a run of COMMON + overrides."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    spawn(_train_watching_buckets,
          COMMON + overrides + [f"checkpoint.dir={run_dir / 'checkpoints'}"], str(run_dir),
          world=ranks, tp=None)
    return read_metrics(run_dir), json.loads((run_dir / "in_flight.json").read_text())


def _assert_same_steps(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(rows, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-4)


def _assert_overlapped(in_flight: list[list[bool]]) -> None:
    """Several buckets, each started by the backward from the second step on (megatron's first
    step learns which gradients each bucket waits for and starts them all at its end)."""
    assert len(in_flight) == 4 and len(in_flight[0]) > 1
    assert not any(in_flight[0]) and all(all(step) for step in in_flight[1:]), in_flight


@pytest.mark.slow
def test_overlapped_reduction_and_gather_train_the_losses_of_no_overlap_and_one_process(
        tmp_path: Path) -> None:
    plain = UNSAVED + ["trainer.eval_interval=2"]
    one, one_buckets = _train(tmp_path, "one", plain, ranks=1)
    assert not any(map(any, one_buckets))  # one rank: nothing to reduce, no overlap
    off, off_buckets = _train(tmp_path, "off", plain + OFF)
    assert len(off_buckets[0]) == 1 and not any(map(any, off_buckets))
    _assert_same_steps(off, one)
    runs = {}
    for name, overrides in (("on", []), ("accumulated", ACCUMULATE),
                            ("gathered", ACCUMULATE + PARAM_GATHER)):
        rows, in_flight = _train(tmp_path, name, plain + BUCKETS + overrides)
        _assert_overlapped(in_flight)
        _assert_same_steps(rows, off)
        _assert_same_steps(rows, one)
        runs[name] = [r["val_loss"] for r in rows if "val_loss" in r]
    # evaluation (micro-batches of 2: the same validation batches) reads the gathered weights
    assert len(runs["gathered"]) == 2
    assert runs["gathered"] == pytest.approx(runs["accumulated"], rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_a_checkpoint_saved_under_the_parameter_overlap_holds_the_steps_weights(
        tmp_path: Path) -> None:
    """The optimizer step updates each rank's shard; the others arrive in the next forward,
    so the save gathers them first (else rank 0 writes the other shards a step old)."""
    _train(tmp_path, "gathered", ACCUMULATE + BUCKETS + PARAM_GATHER
           + ["trainer.max_steps=2"])
    _train(tmp_path, "plain", ACCUMULATE + OFF + ["parallel.distributed_optimizer=true",
                                                  "trainer.max_steps=2"])
    gathered, plain = (Checkpoint(tmp_path / name / "checkpoints" / "iter_0000002")
                       for name in ("gathered", "plain"))
    weights = [key for key in plain.tensors if not key.startswith("optimizer")]
    assert "embedding.word_embeddings.weight" in weights
    for key in weights:
        torch.testing.assert_close(gathered.read(key), plain.read(key), rtol=0, atol=1e-6,
                                   msg=key)


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.overlap_param_gather=true"],
     "trainer.overlap_param_gather=true needs parallel.distributed_optimizer=true and "
     "trainer.overlap_grad_reduce=true (got false, true)"),
    (PARAM_GATHER + OFF, "(got true, false)"),
    (["trainer.ddp_bucket_size=0"], "trainer.ddp_bucket_size=0 must be >= 1"),
    (OFF + ["trainer.ddp_bucket_size=1000"],
     "trainer.ddp_bucket_size=1000 applies only with trainer.overlap_grad_reduce=true"),
])
def test_settings_that_cannot_apply_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_train(compose_config(COMMON + overrides), 2)


def test_the_overlap_settings_pass_validation() -> None:
    validate_train(compose_config(COMMON + BUCKETS + PARAM_GATHER), 2)
    validate_train(compose_config(COMMON + OFF), 2)
    assert compose_config(COMMON).trainer.overlap_grad_reduce  # the default


def test_a_refused_setting_is_one_error_line_and_exit_2(tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    code, output = refused_by_trainer_main(
        COMMON + ["hydra.run.dir=run", "trainer.overlap_param_gather=true"], capsys,
        monkeypatch, tmp_path)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2, output[-3000:]
    assert len(errors) == 1 and "trainer.overlap_param_gather=true needs" in errors[0], output
    assert "Traceback" not in output, output[-3000:]
    assert not (tmp_path / "run").exists()  # refused before Hydra's run directory
