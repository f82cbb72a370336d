"""Attacks through the file system on the checkpoint tools: signals during an `--overwrite`, stale
temporary directories of killed commands, a destination that appears meanwhile, full disks,
symlinked trackers. Start the next attack here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt import disk
from ckpt.__main__ import main
from ckpt.destination import DestinationError, staged
from ckpt.paths import TRACKER
from tests.module_runs import run_module


def _export(root: Path, dst: Path, *extra: str) -> int:
    return main(["export", str(root), str(dst), "--format", "zarr", *extra])


def _old_contents(dst: Path) -> None:
    (dst / "sub").mkdir(parents=True)
    for i in range(5):
        (dst / "sub" / f"old{i}").write_text("old")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sigterm_while_the_old_dst_is_removed_is_held_and_reported_truthfully(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Before: `nothing was written` (143) while DST was replaced and `.DST.old-PID` left
    half-deleted."""
    dst = tmp_path / "dst"
    _old_contents(dst)
    real_rmtree = shutil.rmtree

    def rmtree_then_sigterm(path, *args, **kwargs):
        path = Path(path)
        if ".old-" in path.name:  # the commit removes the old contents: a signal arrives
            (path / "sub" / "old0").unlink()
            os.kill(os.getpid(), signal.SIGTERM)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_then_sigterm)
    assert _export(root, dst, "--overwrite") == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"interrupted by SIGTERM; after {dst} was completely written" in err, err
    assert (dst / "manifest.json").is_file() and not (dst / "sub").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no .dst.old-PID


def test_stale_temporaries_of_killed_commands_are_removed_and_named(root: Path, tmp_path: Path,
                                                                   capsys) -> None:
    dst = tmp_path / "dst"
    _old_contents(dst)
    pid = _dead_pid()
    for name in (f".dst.tmp-{pid}", f".dst.old-{pid}"):
        _old_contents(tmp_path / name)
    assert _export(root, dst, "--overwrite") == 0
    err = capsys.readouterr().err
    assert err.count(f"left by a killed command (pid {pid})") == 2, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_old_contents_stranded_between_the_renames_are_moved_back(root: Path, tmp_path: Path,
                                                                  capsys) -> None:
    """A SIGKILL between `DST -> .DST.old-PID` and `.DST.tmp-PID -> DST`: DST is missing and its
    old contents sit in `.DST.old-PID`; the next command restores them, then refuses DST."""
    pid = _dead_pid()
    _old_contents(tmp_path / f".dst.old-{pid}")
    assert _export(root, tmp_path / "dst") == 2
    err = capsys.readouterr().err
    assert f"moved {tmp_path / f'.dst.old-{pid}'} back to {tmp_path / 'dst'}" in err, err
    assert "is not empty; pass --overwrite" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    assert (tmp_path / "dst" / "sub" / "old4").read_text() == "old"


def test_a_dst_that_appears_meanwhile_is_never_replaced(tmp_path: Path) -> None:
    """Before: the commit moved it aside and removed it (two `export-hf` into one new DST both
    said `wrote`)."""
    dst = tmp_path / "dst"
    with pytest.raises(DestinationError, match="appeared while this command ran"):
        with staged(dst, overwrite=False) as tmp:
            (tmp / "ours").write_text("ours")
            dst.mkdir()
            (dst / "theirs").write_text("theirs")  # another command's output
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]
    assert (dst / "theirs").read_text() == "theirs"
    with staged(tmp_path / "empty", overwrite=False) as tmp:  # an empty DST may be replaced
        (tmp / "ours").write_text("ours")
        (tmp_path / "empty").mkdir()
    assert (tmp_path / "empty" / "ours").is_file()


def test_a_full_disk_during_a_conversion_is_named_and_leaves_nothing(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """torch's zip writer reports ENOSPC as `unexpected pos 704 vs 598`: the free space says."""
    import ckpt.zarr_export as zarr_export

    def full(*args, **kwargs):
        monkeypatch.setattr(disk, "free_bytes", lambda path: 4096)
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 704 vs 598")

    monkeypatch.setattr(zarr_export, "_fused", full)  # after the arrays, before the manifest
    assert _export(root, tmp_path / "dst") == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no space left on device (ENOSPC)" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_that_cannot_fit_is_refused_before_writing(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(disk, "free_bytes", lambda path: 4096)
    for args in (["export", str(root), str(tmp_path / "dst"), "--format", "zarr"],
                 ["reshape", str(root), str(tmp_path / "dst"), "--target-tp", "2"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "not enough space for" in err, err
        assert list(tmp_path.iterdir()) == []


def test_max_shard_bytes_must_be_positive(root: Path, tmp_path: Path, capsys) -> None:
    assert main(["export-hf", str(root), str(tmp_path / "hf"), "--max-shard-bytes", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--max-shard-bytes -5 must be >= 1" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", ["secret", "/dev/zero"])
def test_a_symlinked_tracker_never_shows_what_it_points_at(root: Path, tmp_path: Path,
                                                           target: str, capsys) -> None:
    copy = shutil.copytree(root, tmp_path / "root")
    if target == "secret":
        target = str(tmp_path / "secret")
        Path(target).write_text("TOP-SECRET-BYTES\n")
    (copy / TRACKER).unlink()
    (copy / TRACKER).symlink_to(target)
    assert main(["inspect", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "SECRET" not in err and "\\x00" not in err, err
    if target != "/dev/zero":  # not a file: refused as no checkpoints root, unread
        assert "a symbolic link: its target is not shown" in err


def test_export_hf_into_a_link_to_an_empty_directory_writes_there(root: Path,
                                                                  tmp_path: Path) -> None:
    """Before: the whole export ran, then `DST appeared while this command ran` (the commit's
    exclusive rename met the link). A DST that is a link now stands for its target, decided
    before any work."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    assert main(["export-hf", str(root), str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link"]


def _under_file_size_limit(limit: int, argv: list[str],
                           cwd: Path) -> subprocess.CompletedProcess:
    """`python -m ckpt ARGV` with `ulimit -f` at `limit` bytes (Python ignores SIGXFSZ: a write
    past the limit fails with EFBIG), forked from the preloaded server (tests/conftest.py)."""
    return run_module("ckpt", argv, cwd, timeout=300, file_size_limit=limit)


@pytest.mark.slow  # two runs of the command line: CI runs it
def test_export_hf_under_a_file_size_limit_is_one_line(root: Path, tmp_path: Path) -> None:
    """Before: `SafetensorError: File too large` and a traceback. 1.7 MB of weights: refused
    before any work under a 256 KB limit; with shards of 100 KB, the 196 KB MLP weight crosses
    a 150 KB limit while writing, and the partial output goes."""
    dst = tmp_path / "hf"
    early = _under_file_size_limit(256_000, ["export-hf", str(root), str(dst)], tmp_path)
    assert early.returncode == 2 and len(early.stderr.strip().splitlines()) == 1, early.stderr
    assert "may write files of at most 256.0 KB (ulimit -f)" in early.stderr
    assert "--max-shard-bytes 128000" in early.stderr
    late = _under_file_size_limit(150_000, ["export-hf", str(root), str(dst),
                                            "--max-shard-bytes", "100000"], tmp_path)
    assert late.returncode == 2 and len(late.stderr.strip().splitlines()) == 1, late.stderr
    assert "a file reached this process's file-size limit of 150.0 KB (ulimit -f)" in late.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_file_size_limit_while_writing_removes_the_partial_output(tmp_path: Path) -> None:
    import errno

    with pytest.raises(DestinationError, match="file-size limit .* the partial output was "
                                               "removed"):
        with staged(tmp_path / "dst", overwrite=False) as tmp:
            (tmp / "part").write_text("partial")
            raise OSError(errno.EFBIG, "File too large")
    assert list(tmp_path.iterdir()) == []
