"""Attacks through a checkpoint's own files: an index
whose stored paths lead to another checkpoint's data, a file linked out of its directory, a
rewritten `common.pt` that the exports must refuse as verify and resume do, a reshape of a
damaged source, and the old contents a killed `--overwrite` stranded beside a missing DST."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt.checksums import checkpoint_files, digests, write_manifest
from tests.ckpt.cli import refused
from trainer.errors import UserError
from trainer.init_from import open_load

# The commands that read a checkpoint's tensors, with what each needs besides SRC and DST.
READERS = {"verify": None, "export-hf": [], "export": ["--format", "zarr"],
           "reshape": ["--target-tp", "2"]}


def _copy(root: Path, tmp_path: Path) -> Path:
    """A copy of the test module's checkpoints root (iter_2 and iter_4): returns its iter_4."""
    return shutil.copytree(root, tmp_path / "root") / "iter_0000004"


def _rerecord(ckpt: Path) -> None:
    """Rewrite checksums.json for the files as they are now (the manifest is no signature: an
    attacker who edits a file can edit it too)."""
    write_manifest(ckpt, digests(ckpt, checkpoint_files(ckpt)))


def _redirect(ckpt: Path, target: str) -> None:
    """Point every item the index stores in `__0_0.distcp` at `target`."""
    index = ckpt / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    metadata.storage_data = {
        key: dataclasses.replace(info, relative_path=target)
        if info.relative_path == "__0_0.distcp" else info
        for key, info in metadata.storage_data.items()}
    index.write_bytes(pickle.dumps(metadata))
    _rerecord(ckpt)


def _every_reader_refuses(ckpt: Path, tmp_path: Path, capsys, *words: str) -> None:
    for command, extra in READERS.items():
        dst = [] if extra is None else [str(tmp_path / f"out-{command}"), *extra]
        refused(capsys, [command, str(ckpt), *dst], *words)
        assert not (tmp_path / f"out-{command}").exists()
    with pytest.raises(UserError, match="|".join(words)):  # resume, eval, generate: open_load
        open_load(str(ckpt))


@pytest.mark.parametrize("target", ["../iter_0000002/__0_0.distcp", "ABS", "checksums.json"])
def test_an_index_that_stores_data_outside_its_checkpoint_is_refused(
        root: Path, tmp_path: Path, capsys, target: str) -> None:
    """Before: `.metadata` pointing at iter_2's `.distcp` passed `ckpt verify` ("readable and
    complete"), resumed and exported: checksums.json covers the directory's files only."""
    ckpt = _copy(root, tmp_path)
    if target == "ABS":
        target = str(ckpt.parent / "iter_0000002" / "__0_0.distcp")
    _redirect(ckpt, target)
    (ckpt / "__0_0.distcp").unlink()  # the data really is read from elsewhere
    _rerecord(ckpt)
    _every_reader_refuses(ckpt, tmp_path, capsys, "the index stores data in", repr(target))


def test_a_file_linked_out_of_its_checkpoint_is_refused(root: Path, tmp_path: Path,
                                                        capsys) -> None:
    """`__0_0.distcp` replaced by a link to another checkpoint's file (the manifest re-recorded
    over the target's bytes)."""
    ckpt = _copy(root, tmp_path)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(ckpt.parent / "iter_0000002" / "__0_0.distcp")
    _rerecord(ckpt)
    _every_reader_refuses(ckpt, tmp_path, capsys, "a link to", "outside")


@pytest.mark.parametrize("command", ["export-hf", "export"])
def test_the_exports_check_the_checksums(root: Path, tmp_path: Path, capsys,
                                         command: str) -> None:
    """Before: a `common.pt` rewritten with torch.save (every CRC valid), which verify and
    resume refuse, exported fine."""
    ckpt = _copy(root, tmp_path)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    common["extra"]["consumed_samples"] ^= 1
    torch.save(common, ckpt / "common.pt")
    extra = READERS[command]
    refused(capsys, [command, str(ckpt), str(tmp_path / "out"), *extra],
               f"{ckpt / 'common.pt'}: contents changed since the save",
               f"python -m ckpt verify {ckpt}")
    assert not (tmp_path / "out").exists()


def test_reshape_of_a_damaged_source_says_so_before_starting_its_ranks(
        root: Path, tmp_path: Path, capsys) -> None:
    """Before: `error: rank 1 failed: -- Process 1 terminated with the following error:
    Traceback ...` after two ranks had started."""
    ckpt = _copy(root, tmp_path)
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    refused(capsys, ["reshape", str(ckpt), str(tmp_path / "out"), "--target-tp", "2"],
               f"{ckpt / '__0_0.distcp'}: contents changed since the save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_old_contents_stranded_by_a_kill_between_the_renames_are_named(
        root: Path, tmp_path: Path, capsys) -> None:
    """A SIGKILL between `DST -> .DST.old-PID` and `.DST.tmp-PID -> DST`: DST is missing. Before:
    inspect, verify, export and a resume said only that DST does not exist."""
    pid = _dead_pid()
    old = tmp_path / f".ckpts.old-{pid}"
    shutil.copytree(root, old)
    dst = tmp_path / "ckpts"
    for argv in (["inspect", str(dst)], ["verify", str(dst / "iter_0000004")],
                 ["export", str(dst), str(tmp_path / "z"), "--format", "zarr"]):
        refused(capsys, argv, f"{dst} is missing, but {old} holds its old contents",
                   f"pid {pid}", f"mv {old} {dst}")
    with pytest.raises(UserError, match=f"{old} holds its old contents"):
        open_load(str(dst))
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]  # a reader moves nothing
