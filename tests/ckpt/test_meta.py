"""The checkpoint's typed record (ckpt/meta.py): one writer and reader pair for every tool, and
checkpoints saved before it existed still read, resume, reshape and export.

tests/data/legacy_train_ckpt and legacy_import_ckpt were written by the code at ba6e30c (the
last commit before the record): a 2-step trainer run of
  model.num_layers=2 model.hidden_size=32 model.num_attention_heads=2
  model.make_vocab_size_divisible_by=64 trainer.max_steps=2 trainer.warmup_steps=1
  trainer.seq_length=32 trainer.micro_batch_size=2 trainer.global_batch_size=2
  trainer.eval_interval=0 logger=none
and `python -m ckpt import-hf` of tests/ckpt/hf_models.py's tied llama (`save_hf(dir, "llama",
True)`, vocabulary 300, max_position_embeddings 64).
"""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from ckpt.__main__ import main
from ckpt.meta import CheckpointMeta, HFSource, MetaError
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint, CheckpointError
from models.schema import AttentionConfig, ModelConfig
from parallel.placement import Layout
from tests.conftest import REPO, compose_config, read_metrics
from trainer.train import train

LEGACY_TRAIN = REPO / "tests" / "data" / "legacy_train_ckpt"
LEGACY_IMPORT = REPO / "tests" / "data" / "legacy_import_ckpt"
LEGACY_OVERRIDES = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2",
                    "model.make_vocab_size_divisible_by=64", "trainer.warmup_steps=1",
                    "trainer.seq_length=32", "trainer.micro_batch_size=2",
                    "trainer.global_batch_size=2", "trainer.eval_interval=0", "logger=none"]


def _full_meta() -> CheckpointMeta:
    return CheckpointMeta(
        model=ModelConfig(num_layers=3, rope_scaling_type="yarn", rope_attention_factor=1.2),
        attention=AttentionConfig(kind="dca", dca_chunk_size=64, dca_local_size=16),
        layout=Layout(tp=2, pp=2, vpp=2, dp=3, distributed_optimizer=True), seq_length=128,
        vocab_size=300, tokenizer="tok.json", step=7, consumed_samples=56, seed=5,
        wandb_id="abc", model_only=True,
        hf_source=HFSource("/hf", "LlamaForCausalLM", 300, "{}"),
        reshaped_from=Layout(tp=1), run_config="trainer:\n  seq_length: 128\n")


def test_the_record_round_trips_through_plain_values() -> None:
    meta = _full_meta()
    saved = meta.to_saved()
    buffer = io.BytesIO()  # plain Python only: `torch.load(weights_only=True)` reads it back
    torch.save(saved, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == saved
    assert CheckpointMeta.from_saved(saved, embedding_rows=0, where="x") == meta
    assert CheckpointMeta.from_saved(
        dataclasses.replace(meta, hf_source=None, reshaped_from=None).to_saved(), 0, "x"
    ) == dataclasses.replace(meta, hf_source=None, reshaped_from=None)


@pytest.mark.parametrize("damage, named", [
    (lambda s: s.pop("seq_length"), "seq_length"),
    (lambda s: s["model"].update(num_layerz=2), "num_layerz"),
    (lambda s: s.update(meta_version=99), "meta_version 99"),
])
def test_a_damaged_record_is_refused_naming_the_field(damage, named: str) -> None:
    saved = _full_meta().to_saved()
    damage(saved)
    with pytest.raises(MetaError, match=f"common.pt: .*{named}"):
        CheckpointMeta.from_saved(saved, 0, "ckpt/common.pt")


def test_a_legacy_training_checkpoint_reads_as_a_record() -> None:
    meta = Checkpoint(resolve_checkpoint(LEGACY_TRAIN)).meta
    assert (meta.step, meta.consumed_samples, meta.seq_length) == (2, 4, 32)
    assert (meta.model.num_layers, meta.model.hidden_size, meta.attention.kind) == (2, 32,
                                                                                    "standard")
    assert meta.layout == Layout(tp=1, pp=1, vpp=1, cp=1, dp=1, distributed_optimizer=False)
    assert (meta.vocab_size, meta.tokenizer, meta.seed) == (257, "byte", 1234)
    assert not meta.model_only and meta.hf_source is None and "seq_length: 32" in meta.run_config


def test_a_legacy_import_reads_as_a_record_without_a_made_up_run() -> None:
    meta = Checkpoint(resolve_checkpoint(LEGACY_IMPORT)).meta
    assert meta.model_only and meta.hf_source.architecture == "LlamaForCausalLM"
    assert (meta.vocab_size, meta.hf_source.vocab_size, meta.seq_length) == (300, 300, 64)
    # the placeholder seed and run config import-hf used to forge are not taken for real ones
    assert meta.seed is None and meta.run_config is None


def test_a_legacy_checkpoint_resumes_with_the_current_trainer(tmp_path: Path) -> None:
    root = shutil.copytree(LEGACY_TRAIN, tmp_path / "checkpoints")
    cfg = compose_config(LEGACY_OVERRIDES + ["trainer.max_steps=3",
                                             f"checkpoint.load={root}"])
    train(cfg, tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == [3]
    meta = Checkpoint(resolve_checkpoint(root)).meta  # written in the current format
    assert meta.step == 3 and meta.consumed_samples == 6 and meta.vocab_size == 257


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_legacy_checkpoints_inspect_reshape_and_export(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(LEGACY_TRAIN)]) == 0
    assert "sequence length 32, vocabulary 257, tokenizer byte" in capsys.readouterr().out
    assert main(["reshape", str(LEGACY_TRAIN), str(tmp_path / "tp2"), "--target-tp", "2",
                 "--verify"]) == 0
    reshaped = Checkpoint(resolve_checkpoint(tmp_path / "tp2")).meta
    assert reshaped.layout.tp == 2 and reshaped.reshaped_from.tp == 1 and reshaped.step == 2
    assert main(["export-hf", str(LEGACY_IMPORT), str(tmp_path / "hf")]) == 0
    assert '"vocab_size": 300' in (tmp_path / "hf" / "config.json").read_text()


def test_a_checkpoint_without_a_record_is_refused(tmp_path: Path) -> None:
    ckpt = Checkpoint(resolve_checkpoint(LEGACY_TRAIN))
    ckpt.common = {k: v for k, v in ckpt.common.items() if k != "extra"}
    with pytest.raises(CheckpointError, match="holds no checkpoint record"):
        _ = ckpt.meta


# Run settings the attention block held before they moved to the run config's `trainer` group
# (models.options.MOVED_FROM_ATTENTION), as a record of then wrote them.
OLD_ATTENTION_RUN_SETTINGS = {"kernel": "cudnn", "dca_backward": "one_piece",
                              "dca_keep_rotated": True}


def test_a_record_with_run_settings_in_its_attention_block_reads_without_them() -> None:
    """A record written while AttentionConfig held the kernel and DCA's backward path reads as
    the same model: those keys are dropped, whatever their values (they never were the model)."""
    meta = _full_meta()
    saved = meta.to_saved()
    saved["attention"].update(OLD_ATTENTION_RUN_SETTINGS)
    read = CheckpointMeta.from_saved(saved, embedding_rows=0, where="x")
    assert read == meta
    assert not set(OLD_ATTENTION_RUN_SETTINGS) & set(dataclasses.asdict(read.attention))
    # the format before the record (the run config's attention group) too
    legacy = {"config": "model: {}\nattention:\n  kind: dca\n  kernel: fa4\n  dca_backward: "
                        "parts\n  dca_keep_rotated: true\n  dca_chunk_size: 64\n  "
                        "dca_local_size: 16\ntrainer:\n  seq_length: 32\n", "step": 1}
    old = CheckpointMeta.from_saved(legacy, embedding_rows=256, where="x")
    assert (old.attention.kind, old.attention.dca_chunk_size, old.step) == ("dca", 64, 1)
    # any other key the model's attention does not know is still refused
    saved["attention"]["kernal"] = "fa4"
    with pytest.raises(MetaError, match="kernal"):
        CheckpointMeta.from_saved(saved, 0, "x")


def test_the_record_holds_the_model_and_the_run_config_the_run_settings(tmp_path: Path) -> None:
    """What the model is (the record's `model` and `attention`) holds no run setting; the run
    config saved beside it holds them, under the `trainer` group; every saved value is plain
    (a choice as its string: `weights_only` loads it)."""
    from tests.conftest import FAST

    cfg = compose_config(FAST + ["+attention=dca", "trainer.max_steps=2",
                                 "trainer.attention_kernel=math", "trainer.dca_backward=parts",
                                 "trainer.dca_keep_rotated=true",
                                 f"checkpoint.dir={tmp_path / 'checkpoints'}"])
    train(cfg, tmp_path)
    ckpt = resolve_checkpoint(tmp_path / "checkpoints")
    record = torch.load(ckpt / "common.pt", weights_only=True)["extra"]
    assert record["attention"]["kind"] == "dca" and type(record["attention"]["kind"]) is str
    assert not {"kernel", "attention_kernel", "dca_backward", "dca_keep_rotated"} \
        & (set(record["attention"]) | set(record["model"]))
    run = yaml.safe_load(record["run_config"])
    assert (run["trainer"]["attention_kernel"], run["trainer"]["dca_backward"],
            run["trainer"]["dca_keep_rotated"]) == ("math", "parts", True)
    assert not set(OLD_ATTENTION_RUN_SETTINGS) & set(run["attention"])
    assert Checkpoint(ckpt).meta.attention.kind == "dca"


def _with_run_settings_in_attention(root: Path, dst: Path) -> Path:
    """A copy of `root` whose newest record is as a checkpoint saved before the run settings
    moved wrote it: the kernel and DCA's settings in the record's attention block and in its run
    config's attention group, none in the run config's trainer group."""
    from ckpt.checksums import checkpoint_files, digests, write_manifest

    shutil.copytree(root, dst)
    ckpt = resolve_checkpoint(dst)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    record = common["extra"]
    record["attention"].update(OLD_ATTENTION_RUN_SETTINGS)
    run = yaml.safe_load(record["run_config"])
    for old, new in (("kernel", "attention_kernel"), ("dca_backward", "dca_backward"),
                     ("dca_keep_rotated", "dca_keep_rotated")):
        run["trainer"].pop(new)
        run["attention"][old] = OLD_ATTENTION_RUN_SETTINGS[old]
    record["run_config"] = yaml.safe_dump(run, sort_keys=False)
    torch.save(common, ckpt / "common.pt")
    write_manifest(ckpt, digests(ckpt, checkpoint_files(ckpt)))
    return dst


def test_a_checkpoint_with_run_settings_in_its_attention_resumes_and_evaluates(
        root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Such a checkpoint (tests/ckpt/conftest.py's run, its record rewritten to the old layout)
    verifies, resumes without counting the moved settings as a change, and evaluates; the
    resumed run's checkpoint records them in its run config's trainer group only."""
    import logging

    from trainer import eval as eval_entry

    src = _with_run_settings_in_attention(root, tmp_path / "src")
    assert main(["verify", str(src)]) == 0
    meta = Checkpoint(resolve_checkpoint(src)).meta
    assert meta.attention == AttentionConfig() and "kernel: cudnn" in meta.run_config
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    with caplog.at_level(logging.WARNING):
        train(compose_config(["logger=none", "trainer.seq_length=64", "trainer.micro_batch_size=4",
                              "trainer.global_batch_size=4", "trainer.warmup_steps=1",
                              "trainer.eval_interval=0", "data.max_documents=60",
                              "trainer.max_steps=5", f"checkpoint.load={src}",
                              f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)
    assert [r["step"] for r in read_metrics(run_dir)] == [5]
    assert "kernel" not in caplog.text and "dca_" not in caplog.text, caplog.text
    resumed = torch.load(resolve_checkpoint(run_dir / "checkpoints") / "common.pt",
                         weights_only=True)["extra"]
    assert not set(OLD_ATTENTION_RUN_SETTINGS) & set(resumed["attention"])
    assert yaml.safe_load(resumed["run_config"])["trainer"]["attention_kernel"] == "auto"
    out = tmp_path / "eval"
    out.mkdir()
    results = eval_entry.evaluate(compose_config([
        "logger=none", f"checkpoint.load={src}", "eval.lengths=[256]", "eval.depths=[0.0]",
        "eval.passkey_trials=1", "eval.multikey_trials=0", "eval.perplexity_windows=1",
        "trainer.attention_kernel=math"]), out)
    assert results["trained_attention"] == "standard" and results["attention"]["kind"] == "standard"
    assert "kernel" not in results["attention"] and len(results["perplexity"]) == 1
