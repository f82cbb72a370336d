"""Attacks through a checkpoint's saved run config (`extra.run_config`, or `extra.config` in the
record's older format, which ckpt parses for the model): interpolations that read the
environment, YAML anchors that expand without bound. Every reader goes
through `ckpt.saved_config.read_saved_config`, and every saved value that meets omegaconf through
`ckpt.saved_config.literal`; start the next attack here."""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from ckpt.checksums import checkpoint_files, digests, write_manifest
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from ckpt.saved_config import SavedConfigError, read_saved_config
from tests.conftest import FAST, REPO, compose_config
from tests.module_runs import run_module

SECRET = "s3cr3t-from-the-environment"


def _billion_laughs(levels: int = 9) -> str:
    """Nine levels of nine aliases each: 9**9 leaves once expanded, a few hundred bytes here."""
    lines = ["lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


LEGACY_TRAIN = REPO / "tests" / "data" / "legacy_train_ckpt"  # tests/ckpt/test_meta.py


def _with_config(root: Path, dst: Path, edit, key: str = "run_config") -> Path:
    """A copy of `root` whose newest checkpoint's record has `extra[key] = edit(extra[key])`,
    its checksum manifest rewritten to match (as an attacker would)."""
    shutil.copytree(root, dst)
    ckpt = resolve_checkpoint(dst)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    common["extra"][key] = edit(common["extra"][key])
    torch.save(common, ckpt / "common.pt")
    write_manifest(ckpt, digests(ckpt, checkpoint_files(ckpt)))
    return dst


def test_interpolations_are_read_as_their_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADV_SECRET", SECRET)
    texts = ["${oc.env:ADV_SECRET}", "${data.name}", "a\\${x}", "a\\\\${oc.env:ADV_SECRET}",
             "${oc.env:ADV_SECRET,${data.name}}", "\\", "${"]
    cfg = read_saved_config(yaml.safe_dump({"data": {"name": "x", "values": texts}, "lr": 1e-3}))
    assert OmegaConf.to_container(cfg, resolve=True)["data"]["values"] == texts
    assert SECRET not in OmegaConf.to_yaml(cfg, resolve=True)
    assert cfg.lr == 1e-3  # omegaconf's YAML rules still apply to the values


@pytest.mark.parametrize("text, message", [
    (_billion_laughs(), "anchors or aliases"),
    ("a: &x 1\nb: *x\n", "anchors or aliases"),
    ("[" * 200 + "]" * 200, "levels deep"),
    ("a: " + "x" * (2 << 20), "over the limit"),
    ("- 1\n- 2\n", "not a mapping"),
    ("a: [1,\n", "not valid YAML"),
    (b"model: {}", "not YAML text"),
])
def test_hostile_or_malformed_configs_are_refused_fast(text, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(SavedConfigError, match=message):
        read_saved_config(text)
    assert time.perf_counter() - start < 2


def test_a_resume_never_resolves_the_saved_config(root: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The saved `data.name` reads the environment: the resume's settings warning named its value,
    and so did everything else that read the config."""
    from trainer.train import train

    monkeypatch.setenv("ADV_SECRET", SECRET)
    src = _with_config(root, tmp_path / "src", lambda text: re.sub(
        r"(?m)^  name: embedded$", "  name: ${oc.env:ADV_SECRET}", text, count=1))
    assert "${oc.env:ADV_SECRET}" in Checkpoint(resolve_checkpoint(src)).meta.run_config
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    with caplog.at_level(logging.INFO):
        train(compose_config(FAST + ["trainer.max_steps=5", f"checkpoint.load={src}",
                                     f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)
    assert "data.name=embedded (saved: ${oc.env:ADV_SECRET})" in caplog.text
    assert SECRET not in caplog.text
    saved = Checkpoint(resolve_checkpoint(run_dir / "checkpoints")).meta
    assert SECRET not in saved.run_config and SECRET not in str(saved)


def test_a_fine_tune_never_resolves_the_saved_model(root: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The record's model settings are plain values, but they meet omegaconf when a run adopts
    them: a `${...}` there stays text."""
    from trainer.train import train

    monkeypatch.setenv("ADV_SECRET", SECRET)
    src = _with_config(root, tmp_path / "src", lambda model: {**model,
                                                             "name": "${oc.env:ADV_SECRET}"},
                       key="model")
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    with caplog.at_level(logging.INFO):
        train(compose_config(FAST + ["trainer.max_steps=5", f"checkpoint.load={src}",
                                     f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)
    assert "model ${oc.env:ADV_SECRET}:" in caplog.text and SECRET not in caplog.text
    saved = Checkpoint(resolve_checkpoint(run_dir / "checkpoints")).meta
    assert saved.model.name == "${oc.env:ADV_SECRET}" and SECRET not in saved.run_config


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_ckpt_inspect_refuses_a_billion_laughs_in_one_line(root: Path, tmp_path: Path) -> None:
    """Before: CPU-bound and hundreds of MB, still growing after two minutes."""
    bomb = _with_config(LEGACY_TRAIN, tmp_path / "bomb", lambda text: text + _billion_laughs(),
                        key="config")
    proc = run_module("ckpt", ["inspect", str(bomb)], tmp_path, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1 and "anchors or aliases" in proc.stderr


def test_ckpt_inspect_shows_an_interpolation_as_written(root: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys) -> None:
    from ckpt.__main__ import main

    monkeypatch.setenv("ADV_SECRET", SECRET)
    src = _with_config(LEGACY_TRAIN, tmp_path / "src", lambda text: re.sub(
        r"(?m)^  name: tiny$", "  name: ${oc.env:ADV_SECRET}", text, count=1), key="config")
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "model ${oc.env:ADV_SECRET}:" in out and SECRET not in out, out[:500]
