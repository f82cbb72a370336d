"""In-process training: loss falls, exact resume, crash-safe checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from ckpt.paths import TRACKER, resolve_checkpoint
from tests.conftest import FAST, compose_config, read_metrics, spawn
from trainer.train import _memory_gb, train


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 5-step run that saved every 2 steps and its last step (iter 2, 4 and 5), trained once
    for the tests that read it; a test that changes it works on a copy."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run_dir.mkdir()
    train(compose_config(FAST + [f"checkpoint.dir={run_dir / 'checkpoints'}",
                                 "trainer.max_steps=5", "trainer.save_interval=2"]), run_dir)
    return run_dir


def test_training_reduces_loss_and_writes_outputs(run_training, tmp_path: Path) -> None:
    rows = run_training(["trainer.max_steps=30", "trainer.save_interval=30",
                         "trainer.eval_interval=15", "trainer.lr=3e-3"])
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "memory_gb"):
        assert key in rows[0]
    assert "val_loss" in rows[14] and "val_loss" in rows[29]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert resolve_checkpoint(tmp_path / "run" / "checkpoints").name == "iter_0000030"


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_resume_reproduces_the_uninterrupted_losses_exactly(run_training, tmp_path: Path) -> None:
    # The acceptance case: resume at step 20 of a 40-step run.
    full = run_training(["trainer.max_steps=40", "trainer.save_interval=20"], name="full")
    ckpt = tmp_path / "full" / "checkpoints" / "iter_0000020"
    resumed = run_training(["trainer.max_steps=40", f"checkpoint.load={ckpt}"], name="resumed")
    assert [r["step"] for r in resumed] == list(range(21, 41))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[20:]]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full[20:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[20:]]


def test_checkpoints_root_loads_the_latest_complete_one(saved_run: Path, tmp_path: Path) -> None:
    root = saved_run / "checkpoints"
    assert (root / TRACKER).read_text().strip() == "5"
    assert resolve_checkpoint(root) == root / "iter_0000005"
    assert resolve_checkpoint(root / "iter_0000002") == root / "iter_0000002"
    with pytest.raises(FileNotFoundError, match="neither a checkpoints root"):
        resolve_checkpoint(tmp_path)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(
        run_training, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = dist_checkpointing.save

    def dies_at_step_4(state, directory, **kwargs):
        if directory.endswith("iter_0000004.tmp"):
            real_save(state, directory, **kwargs)  # the shards are written...
            raise RuntimeError("killed mid-save")  # ...but the save never completes
        return real_save(state, directory, **kwargs)

    monkeypatch.setattr(dist_checkpointing, "save", dies_at_step_4)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        run_training(["trainer.max_steps=4", "trainer.save_interval=2"], name="crash")
    if dist.is_initialized():  # the failed run left its process group behind
        dist.destroy_process_group()
    root = tmp_path / "crash" / "checkpoints"
    assert (root / "iter_0000004.tmp").is_dir() and not (root / "iter_0000004").exists()
    assert resolve_checkpoint(root).name == "iter_0000002"

    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    resumed = run_training(["trainer.max_steps=4", f"checkpoint.load={root}",
                            f"checkpoint.dir={root}", "trainer.save_interval=2"], name="again")
    assert [r["step"] for r in resumed] == [3, 4]
    assert not (root / "iter_0000004.tmp").exists()
    assert resolve_checkpoint(root).name == "iter_0000004"


def test_checkpoint_records_what_a_resume_needs(saved_run: Path) -> None:
    extra = dist_checkpointing.load_common_state_dict(
        str(saved_run / "checkpoints" / "iter_0000002"))["extra"]
    assert extra["step"] == 2 and extra["consumed_samples"] == 8 and extra["layout"]["tp"] == 1
    assert "model:" in extra["run_config"] and "wandb_id" in extra
    assert extra["model"]["num_layers"] == 2 and extra["meta_version"] == 2
    assert [r["step"] for r in read_metrics(saved_run)] == [1, 2, 3, 4, 5]


def test_a_fresh_run_in_a_reused_directory_keeps_old_metrics_aside(run_training,
                                                                    tmp_path: Path) -> None:
    # save=false over a save interval: no checkpoint at all
    run_training(["trainer.max_steps=2", "trainer.save_interval=1", "checkpoint.save=false"])
    rows = run_training(["trainer.max_steps=3", "trainer.save_interval=2",
                         "checkpoint.save=false"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    old = list((tmp_path / "run").glob("metrics.*.jsonl"))
    assert len(old) == 1 and len(old[0].read_text().splitlines()) == 2
    assert not (tmp_path / "run" / "checkpoints").exists()


def _report_memory(root: str) -> None:
    """Rank r pretends to hold r + 1 GiB and writes what `_memory_gb` reports."""
    rank = dist.get_rank()
    rss = SimpleNamespace(rss=(rank + 1) * 2**30)
    with mock.patch("psutil.Process.memory_info", return_value=rss):
        Path(root, f"rank{rank}").write_text(repr(_memory_gb(torch.device("cpu"))))


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_logged_memory_is_the_peak_of_the_most_loaded_rank(tmp_path: Path) -> None:
    spawn(_report_memory, str(tmp_path), world=2, tp=1)
    assert [float((tmp_path / f"rank{r}").read_text()) for r in range(2)] == [2.0, 2.0]


def test_the_final_step_is_saved_off_the_save_interval(saved_run: Path) -> None:
    root = saved_run / "checkpoints"
    assert sorted(p.name for p in root.glob("iter_*")) == [
        "iter_0000002", "iter_0000004", "iter_0000005"]
    assert resolve_checkpoint(root).name == "iter_0000005"


def test_a_resume_into_the_same_directory_logs_each_step_once(run_training, saved_run: Path,
                                                              tmp_path: Path) -> None:
    # The run saved at step 2 and died after logging step 5, before its saves at 4 and 5:
    # resuming from step 2 repeats steps 3 to 5.
    shutil.copytree(saved_run, tmp_path / "run", ignore=shutil.ignore_patterns("run.lock"))
    first = read_metrics(tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    shutil.rmtree(root / "iter_0000004")
    shutil.rmtree(root / "iter_0000005")
    (root / TRACKER).write_text("2\n")
    rows = run_training(["trainer.max_steps=5", f"checkpoint.load={root}"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[:2] == first[:2]
    aside = list((tmp_path / "run").glob("metrics.*.jsonl"))
    assert len(aside) == 1
    assert [json.loads(line)["step"] for line in aside[0].read_text().splitlines()] == [3, 4, 5]


def test_retrieval_examples_reach_the_training_batches(run_training,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """data.passkey_fraction / multikey_fraction / multikey_keys build the mix the data
    iterator applies: both kinds of example are drawn during a short run."""
    from trainer import train
    from trainer.evals import retrieval_mix

    drawn: list[str] = []

    class Recording(retrieval_mix.PasskeyMix):
        def __call__(self, g, sample):
            out = super().__call__(g, sample)
            text = self.tokenizer.decode(out.tolist())
            drawn.append("corpus" if torch.equal(out, sample) else
                         "multikey" if "What is the pass key for" in text else "passkey")
            return out

    monkeypatch.setattr(train, "PasskeyMix", Recording)
    run_training(["trainer.max_steps=4", "trainer.seq_length=384", "data.passkey_fraction=0.3",
                  "data.multikey_fraction=0.3", "data.multikey_keys=2", "checkpoint.save=false"])
    assert len(drawn) >= 16 and {"corpus", "passkey", "multikey"} <= set(drawn)
