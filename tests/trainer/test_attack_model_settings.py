"""Hostile model settings, evaluation lengths, tokenizer files and environment interpolations
given to `python -m trainer`, `trainer.eval` and `trainer.build_data`.

Model settings out of range ended in tracebacks (`model.rope_theta=-1`, `model.kv_channels=0`,
`model.normalization=BatchNorm`, ...) or hung (`model.num_layers=1000000000`); now the check every
model source shares (`models/validation.py`) refuses each in one line before anything is built.
`eval.lengths=[10000000]` is checked against the memory its logits and prefill need before the
model loads; a malformed tokenizer JSON is one line; an `${oc.env:...}` interpolation is never
written resolved (the checkpoint's saved config, the config wandb gets) and is refused in the
wandb settings wandb itself writes down. The next attacker of these settings starts here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST, compose_config
from trainer.errors import UserError
from trainer.train import Trainer, train

SECRET = "s3cr3t-from-the-environment"


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("reached past the up-front checks")


@pytest.mark.parametrize(("override", "message"), [
    ("model.rope_theta=-1", "model.rope_theta=-1.0 must be a finite number > 0"),
    ("model.normalization=BatchNorm", "model.normalization='BatchNorm' must be one of RMSNorm"),
    ("model.hidden_size=1000000000", "model.hidden_size=1000000000 must be a whole number in"),
    ("model.num_layers=1000000000", "model.num_layers=1000000000 must be a whole number in"),
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0 must be"),
    ("model.init_std=-1", "model.init_std=-1.0 must be a finite number > 0"),
    ("model.kv_channels=0", "model.kv_channels=0 must be a whole number in [1, "),
    ("model.kv_channels=7", "the head dimension (7) must be even"),
    ("model.ffn_hidden_size=0", "model.ffn_hidden_size=0 must be a whole number"),
    ("model.num_attention_heads=2000", "model.num_attention_heads=2000"),
    ("model.rope_scaling_type=evil", "model.rope_scaling_type='evil' must be one of"),
    ("model.rope_scaling_factor=inf", "model.rope_scaling_factor=inf"),
    ("attention.head_wise_attn_gate_init_weight_scale=nan",
     "attention.head_wise_attn_gate_init_weight_scale=nan must be a finite number"),
    ("attention.head_wise_attn_gate_init_bias=inf", "attention.head_wise_attn_gate_init_bias=inf"),
    ("attention.chunk_size=-3", "attention.chunk_size=-3 must be a whole number"),
    ("trainer.seq_length=2000000000", "trainer.seq_length=2000000000 must be at most"),
])
def test_a_bad_model_setting_is_one_line_before_anything_is_built(
        override: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_config(FAST + [override])
    monkeypatch.setattr(Trainer, "_setup_parallel", _must_not_run)
    monkeypatch.setattr(Trainer, "_setup_model", _must_not_run)
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        Trainer(cfg, tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value), info.value
    assert time.monotonic() - start < 10  # a billion layers hung over 60 s


@pytest.mark.parametrize(("lengths", "message"), [
    ("[10000000]", "eval.lengths=[10000000]: one sequence of 10000000 tokens needs about"),
    ("[2000000000]", "eval.lengths=[2000000000]: give positive context lengths (at most"),
])
def test_an_evaluation_too_long_for_the_memory_is_refused_before_the_model_loads(
        two_step_checkpoints: Path, lengths: str, message: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval.lengths=[10000000]` ended in a `can't allocate` traceback in the first forward."""
    import psutil

    import trainer.data.datasets
    from trainer import eval as eval_entry

    # the logits alone: 10^7 x 257 x 8 bytes = 20 GB; the check holds them against 16 GB free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 16 << 30}))
    monkeypatch.setattr(eval_entry, "load_model", _must_not_run)
    monkeypatch.setattr(trainer.data.datasets, "build_datasets", _must_not_run)
    cfg = compose_config(["logger=none", f"eval.lengths={lengths}", "eval.batch_size=1",
                          f"checkpoint.load={two_step_checkpoints}"])
    with pytest.raises(UserError) as info:
        eval_entry.evaluate(cfg, tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value), info.value
    if "needs about" in message:
        assert "logits [1, 10000000, 384]" in str(info.value) and "eval.lengths" in str(
            info.value)


def test_a_batch_too_large_for_the_memory_forwards_fewer_windows(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """eval.batch_size is honoured as far as memory allows: the perplexity forwards as many
    windows as fit, said in one line, instead of refusing the evaluation."""
    import logging

    import psutil
    import torch
    from omegaconf import OmegaConf

    from models.schema import ModelConfig
    from trainer.eval_fit import perplexity_rows

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    e = OmegaConf.create({"lengths": [4096], "batch_size": 16, "perplexity_windows": 8})
    one_row = 4096 * 256 * 12  # logits of one window, fp32 + the float copy and log-softmax
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: type("VM", (), {"available": 3 * one_row + (4 << 20)}))
    with caplog.at_level(logging.INFO, logger="trainer.eval_fit"):
        rows = perplexity_rows(model, 256, e, 1, False, torch.device("cpu"))
    assert 1 <= rows < 8, rows  # fewer than the 8 windows asked for, at least one
    assert "forwards" in caplog.text and "eval.batch_size 16" in caplog.text
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: type("VM", (), {"available": 1 << 40}))
    assert perplexity_rows(model, 256, e, 1, False, torch.device("cpu")) == 8


@pytest.mark.parametrize("text", ['{"model": {"type": "nonsense"}}', "{", "[1, 2]", "\xff"],
                         ids=["not a tokenizer", "truncated", "a list", "binary"])
def test_a_malformed_tokenizer_json_is_one_line(tmp_path: Path, monkeypatch, capsys,
                                                text: str) -> None:
    from trainer.build_data import main

    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "BAD.json"
    bad.write_bytes(text.encode("latin-1"))
    (tmp_path / "doc.txt").write_text("The grass is green. " * 20)
    assert main(["doc.txt", "--output-prefix", "ds", "--tokenizer", str(bad)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and f"{bad}: not a `tokenizers` JSON file" in lines[0], err
    assert "Traceback" not in err
    with pytest.raises(UserError, match="not a `tokenizers` JSON file"):
        train(compose_config(FAST + [f"data.tokenizer={bad}", "trainer.max_steps=2"]),
              tmp_path)


def test_a_tokenizer_config_that_is_not_an_object_is_one_line(tmp_path: Path) -> None:
    from tests.ckpt.hf_models import save_tokenizer
    from trainer.data.tokenizer import load_tokenizer

    directory = save_tokenizer(tmp_path / "tok")
    (directory / "tokenizer_config.json").write_text('["eos_token"]')
    with pytest.raises(UserError, match="tokenizer_config.json: must hold a JSON object"):
        load_tokenizer(str(directory))


def test_an_environment_interpolation_is_never_written_resolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`${oc.env:...}` landed resolved in the checkpoint's saved config (common.pt), hence in
    `ckpt export`'s manifest.json, and in the config wandb writes to its files."""
    from ckpt.__main__ import main as ckpt_main
    from ckpt.paths import resolve_checkpoint
    from ckpt.reader import Checkpoint
    from trainer import metrics

    monkeypatch.setenv("MYSECRET", SECRET)
    seen: dict[str, Any] = {}

    class Run:
        id = "abc123"

        def log(self, *args: object, **kwargs: object) -> None:
            pass

        def finish(self) -> None:
            pass

    def start_wandb(run_dir: Path, cfg: Any, config: dict, run_id: Any, **kw: Any) -> Run:
        seen["config"], seen["project"] = config, cfg.project
        return Run()

    monkeypatch.setattr(metrics, "start_wandb", start_wandb)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = FAST + ["logger=wandb", "trainer.max_steps=2", "trainer.save_interval=2",
                        "model.name=${oc.env:MYSECRET}", "data.tokenizer=byte",
                        "logger.tags=[${model.name}]", f"checkpoint.dir={run_dir / 'ckpts'}"]
    with pytest.raises(UserError, match=r"logger.tags=\['\$\{oc.env:MYSECRET\}'\] reads the "):
        train(compose_config(overrides), run_dir)  # wandb writes its tags down itself
    with caplog.at_level(logging.INFO):
        train(compose_config(overrides[:-2] + [f"checkpoint.dir={run_dir / 'ckpts'}"]), run_dir)
    assert "model ${oc.env:MYSECRET}:" in caplog.text and SECRET not in caplog.text
    assert seen["config"]["model"]["name"] == "${oc.env:MYSECRET}", seen["config"]["model"]
    assert SECRET not in str(seen["config"])
    meta = Checkpoint(resolve_checkpoint(run_dir / "ckpts")).meta
    assert "name: ${oc.env:MYSECRET}" in meta.run_config and SECRET not in meta.run_config
    assert meta.model.name == "${oc.env:MYSECRET}"
    common = (resolve_checkpoint(run_dir / "ckpts") / "common.pt").read_bytes()
    assert SECRET.encode() not in common
    assert ckpt_main(["export", str(run_dir / "ckpts"), str(tmp_path / "zarr"),
                      "--format", "zarr"]) == 0
    manifest = (tmp_path / "zarr" / "manifest.json").read_text()
    assert "${oc.env:MYSECRET}" in manifest and SECRET not in manifest


@pytest.mark.parametrize("override", ["logger.project=${oc.env:MYSECRET}",
                                      "logger.entity=${oc.env:MYSECRET}",
                                      "logger.name=run-${oc.env:MYSECRET}"])
def test_wandb_settings_read_from_the_environment_are_refused(
        override: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb writes its project, entity, name, group and tags into its own files (debug.log):
    `logger.project=${oc.env:MYSECRET}` put the secret there."""
    from trainer.validate import validate_train

    monkeypatch.setenv("MYSECRET", SECRET)
    key = override.split("=")[0]
    with pytest.raises(UserError, match=f"{key}=.*reads the environment") as info:
        validate_train(compose_config(FAST + ["logger=wandb", override]))
    assert SECRET not in str(info.value)
    validate_train(compose_config(FAST + [override]))  # logger=none: nothing goes to wandb
