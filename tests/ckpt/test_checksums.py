"""The checksum manifest: written by every save, checked by every load and by `ckpt verify`."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.__main__ import main
from ckpt.checksums import MANIFEST, checksum_problems, digests, write_manifest
from ckpt.reader import CheckpointError
from parallel.distributed import shutdown
from tests.conftest import FAST, compose_config
from trainer.train import train

pytestmark = pytest.mark.slow  # trains and saves; the quick lane (-m 'not slow') leaves it to CI


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`iter_0000002` of a 2-step TP=1 run."""
    run_dir = tmp_path_factory.mktemp("run")
    train(compose_config(FAST + ["trainer.max_steps=2", "trainer.save_interval=2",
                                 f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)
    return run_dir / "checkpoints" / "iter_0000002"


def resume(ckpt: Path, run_dir: Path) -> None:
    run_dir.mkdir()
    train(compose_config(FAST + ["trainer.max_steps=3", f"checkpoint.load={ckpt}",
                                 f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)


def test_the_manifest_records_every_file_with_its_size_and_sha256(saved: Path) -> None:
    files = json.loads((saved / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in saved.iterdir() if p.name != MANIFEST)
    assert sorted(files) == on_disk and {"common.pt", ".metadata", "metadata.json"} <= set(files)
    for name in on_disk:
        data = (saved / name).read_bytes()
        assert files[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _consumed_samples(common: dict[str, Any]) -> None:
    common["extra"]["consumed_samples"] ^= 1


def _rope_theta(common: dict[str, Any]) -> None:
    common["extra"]["model"]["rope_theta"] *= 2


@pytest.mark.parametrize("change", [_consumed_samples, _rope_theta])
def test_a_rewritten_common_pt_fails_verify_and_resume(saved: Path, tmp_path: Path, change,
                                                       capsys) -> None:
    ckpt = shutil.copytree(saved, tmp_path / saved.name)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    change(common)
    torch.save(common, ckpt / "common.pt")  # a valid zip: every CRC matches its new contents
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {ckpt / 'common.pt'}: contents changed" in out
    try:
        with pytest.raises(CheckpointError, match=str(ckpt / "common.pt")):
            resume(ckpt, tmp_path / "resumed")
    finally:
        shutdown()  # a Trainer that fails while being built leaves megatron's groups behind
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


def test_an_extra_file_is_named(saved: Path, tmp_path: Path, capsys) -> None:
    ckpt = shutil.copytree(saved, tmp_path / saved.name)
    (ckpt / "__9_0.distcp").write_bytes(b"left over")
    assert main(["verify", str(ckpt)]) == 1
    assert f"FAIL {ckpt / '__9_0.distcp'}: extra file" in capsys.readouterr().out


def test_problems_name_each_changed_missing_and_extra_file(tmp_path: Path) -> None:
    for name, data in [("a", b"1" * 10), ("b", b"2"), ("c", b"3")]:
        (tmp_path / name).write_bytes(data)
    write_manifest(tmp_path, digests(tmp_path, ["a", "b", "c"]))
    assert checksum_problems(tmp_path) == []
    (tmp_path / "a").write_bytes(b"1" * 9 + b"0")  # same size
    (tmp_path / "b").write_bytes(b"22")
    (tmp_path / "c").unlink()
    (tmp_path / "d").write_bytes(b"")
    problems = checksum_problems(tmp_path)
    assert len(problems) == 4
    assert problems[0].startswith(f"{tmp_path / 'c'}: missing")
    assert problems[1].startswith(f"{tmp_path / 'd'}: extra file")
    assert {p.split(":")[0] for p in problems[2:]} == {str(tmp_path / "a"), str(tmp_path / "b")}
    # Two ranks' shares together check every file once; only share 0 compares the listing.
    shares = checksum_problems(tmp_path, (0, 2)) + checksum_problems(tmp_path, (1, 2))
    assert sorted(shares) == sorted(problems)


def test_a_checkpoint_without_a_manifest_still_loads_with_one_warning(
        saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys) -> None:
    ckpt = shutil.copytree(saved, tmp_path / saved.name)
    (ckpt / MANIFEST).unlink()
    assert main(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().err.count(f"warning: {ckpt} has no {MANIFEST}") == 1
    with caplog.at_level(logging.WARNING, logger="ckpt.load"):
        resume(ckpt, tmp_path / "resumed")
    warnings = [r for r in caplog.records if MANIFEST in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert json.loads((tmp_path / "resumed" / "metrics.jsonl").read_text())["step"] == 3
