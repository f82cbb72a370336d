"""Sequence parallelism with the fused RMSNorm (models/fused_rmsnorm.py): at TP=2 each rank
normalises half of every sequence and megatron's `finalize_model_grads` sums the norm weights'
gradients over the TP group, so TP=2 with sequence parallelism trains the losses and the norm
gradients of TP=2 without it and of one process (gloo on the CPU, tiny model). The combinations
that cannot run are refused before anything is built, as one `error:` line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models.config import LongContextConfig
from models.fused_rmsnorm import FusedRMSNorm
from tests.conftest import FAST, compose_config, refused_by_trainer_main, spawn
from trainer.errors import UserError
from trainer.validate import validate_eval, validate_train

COMMON = FAST + ["trainer.max_steps=3", "checkpoint.save=false", "trainer.device=cpu"]
FUSED = ["trainer.fused_norm=true"]
SP = FUSED + ["parallel.tp=2", "parallel.sequence_parallel=true"]


def _train_recording_norm_grads(overrides: list[str], run_dir: str) -> None:
    """Train as `trainer.train` does, writing each step's loss and norm weight gradients (the
    reduced ones the optimizer used) to run_dir/norm_grads.<rank>."""
    from parallel.distributed import unwrap_model
    from trainer.train import Trainer

    trainer = Trainer(compose_config(overrides), Path(run_dir))
    try:
        steps = []
        for _ in range(trainer.cfg.trainer.max_steps):
            loss, _ = trainer.train_step()
            norms = {name: p.main_grad.clone()
                     for name, p in unwrap_model(trainer.model[0]).named_parameters()
                     if name.endswith("layernorm.weight")}
            steps.append((loss, norms))
        torch.save(steps, Path(run_dir) / f"norm_grads.{dist.get_rank()}")
    finally:
        trainer.close()


def _steps(tmp_path: Path, name: str, layout: list[str], ranks: int) -> list[list]:
    """Every rank's [(loss, {norm weight: gradient})] per step."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    spawn(_train_recording_norm_grads,
          COMMON + layout + [f"checkpoint.dir={run_dir / 'checkpoints'}"], str(run_dir),
          world=ranks, tp=None)
    return [torch.load(run_dir / f"norm_grads.{rank}") for rank in range(ranks)]


@pytest.mark.slow
def test_tp2_sequence_parallel_trains_the_losses_and_norm_gradients_of_tp2_and_one_process(
        tmp_path: Path) -> None:
    [one] = _steps(tmp_path, "one", FUSED, 1)
    tp2 = _steps(tmp_path, "tp2", FUSED + ["parallel.tp=2"], 2)
    sp = _steps(tmp_path, "sp", SP, 2)
    names = set(one[0][1])
    assert len(names) == 5  # two per layer and the final norm
    for rank in range(2):
        for step, (loss, grads) in enumerate(sp[rank]):
            for other in (one, tp2[rank]):
                assert loss == pytest.approx(other[step][0], rel=1e-5, abs=1e-5), step
                assert grads.keys() == names
                for name in names:  # each rank's slice alone gives about half the gradient
                    torch.testing.assert_close(grads[name], other[step][1][name], rtol=1e-4,
                                               atol=1e-6, msg=f"{name} at step {step + 1}")


def test_the_fused_norm_builds_under_sequence_parallelism_and_marks_its_weight() -> None:
    config = LongContextConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               normalization="RMSNorm", fused_rmsnorm=True,
                               tensor_model_parallel_size=2, sequence_parallel=True)
    norm = FusedRMSNorm(config, 64)
    assert norm.weight.sequence_parallel is True  # what finalize_model_grads sums over TP
    validate_train(compose_config(COMMON + SP), 2)


@pytest.mark.parametrize(("overrides", "world", "message"), [
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     "parallel.sequence_parallel=true needs trainer.fused_norm=true and "
     "model.normalization=RMSNorm (got fused_norm=false, RMSNorm)"),
    (SP + ["model.normalization=LayerNorm"], 2, "(got fused_norm=true, LayerNorm)"),
    (FUSED + ["parallel.sequence_parallel=true"], 1, "it needs parallel.tp > 1 (got 1)"),
    (SP + ["trainer.seq_length=65"], 2,
     "trainer.seq_length (65) must be divisible by parallel.tp x parallel.cp (2 x 1)"),
])
def test_combinations_that_cannot_run_are_refused(overrides: list[str], world: int,
                                                   message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_train(compose_config(COMMON + overrides), world)


def test_eval_refuses_sequence_parallelism(tmp_path: Path) -> None:
    cfg = compose_config(["logger=none", "parallel.tp=2", "parallel.sequence_parallel=true",
                          f"checkpoint.load={tmp_path}"])
    with pytest.raises(UserError, match="set parallel.sequence_parallel=false"):
        validate_eval(cfg)


def test_a_refused_combination_is_one_error_line_and_exit_2(tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    """As rank 0 of two checks it, before the process group forms."""
    code, output = refused_by_trainer_main(
        COMMON + ["hydra.run.dir=run", "parallel.tp=2", "parallel.sequence_parallel=true"],
        capsys, monkeypatch, tmp_path, {"WORLD_SIZE": "2", "RANK": "0"})
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2, output[-3000:]
    assert len(errors) == 1 and "set trainer.fused_norm=true" in errors[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
