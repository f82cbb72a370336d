"""The destinations of `python -m ckpt` commands under attack.

Two commands writing the same new DST at once (the second must not replace the first without
--overwrite), a DST under a file or on a read-only file system (one `error:` line before any
work, not a traceback at the end), and export-hf's shard size.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckpt.hf_export
from ckpt.__main__ import main
from ckpt.destination import DestinationError, staged
from tests.ckpt import hf_models
from tests.ckpt.cli import refused

hf_imported = hf_models.hf_imported  # the shared fixture

def _write(dst: Path) -> None:
    with staged(dst, False) as tmp:
        (tmp / "who").write_text("other")


def _other_command_writes(dst: Path) -> None:
    """Another process (a fork of this one) writes DST completely (check, stage, rename)."""
    other = mp.get_context("fork").Process(target=_write, args=(dst,))
    other.start()
    other.join(120)
    assert other.exitcode == 0


def test_a_new_dst_written_meanwhile_by_another_command_is_kept(tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    with pytest.raises(DestinationError, match="appeared while this command ran"):  # noqa: PT012
        with staged(dst, False) as tmp:
            (tmp / "who").write_text("this")
            _other_command_writes(dst)  # both saw no DST; the other one finishes first
    assert (dst / "who").read_text() == "other"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no .dst.tmp-PID left


def test_an_empty_dst_is_still_filled_and_overwrite_still_replaces(tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    with staged(tmp_path / "dst", False) as tmp:
        (tmp / "who").write_text("first")
    with staged(tmp_path / "dst", True) as tmp:
        (tmp / "who").write_text("second")
    assert (tmp_path / "dst" / "who").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_two_export_hf_into_one_new_dst(hf_imported, tmp_path: Path, capsys,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack as found: export-hf A and B into the same absent DST, B finishing while A
    writes its weights. Both used to exit 0 "wrote", A's output replacing B's."""
    _, imported = hf_imported("llama", False)
    dst = tmp_path / "hf_out"
    write = ckpt.hf_export._write_weights

    def b_finishes_first(out: Path, tensors, max_shard_bytes: int) -> None:
        _other_command_writes(dst)
        write(out, tensors, max_shard_bytes)

    monkeypatch.setattr(ckpt.hf_export, "_write_weights", b_finishes_first)
    capsys.readouterr()
    assert main(["export-hf", str(imported), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {dst} appeared while this command ran"), err
    assert sorted(p.name for p in dst.iterdir()) == ["who"]


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing may be created in: mode 0555, or for root (whom modes do not stop)
    a read-only tmpfs when this machine lets us mount one."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("running as root and cannot mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("command", ["export-hf", "reshape"])
def test_a_dst_under_a_file_is_one_error_line(hf_imported, tmp_path: Path, capsys,
                                             command: str) -> None:
    _, imported = hf_imported("llama", False)
    (tmp_path / "file").write_text("not a directory")
    extra = ["--target-tp", "2"] if command == "reshape" else []
    refused(capsys, [command, str(imported), str(tmp_path / "file" / "sub" / "dst"), *extra],
               f"under the file {tmp_path / 'file'}")


@pytest.mark.parametrize("command", ["export-hf", "reshape"])
def test_a_read_only_dst_is_one_error_line(hf_imported, read_only_dir: Path, capsys,
                                          command: str) -> None:
    _, imported = hf_imported("llama", False)
    extra = ["--target-tp", "2"] if command == "reshape" else []
    refused(capsys, [command, str(imported), str(read_only_dir / "dst"), *extra],
               f"{read_only_dir} is not writable")
    assert not any(read_only_dir.iterdir())


@pytest.mark.parametrize("size", ["-5", "0"])
def test_a_shard_size_below_one_byte_is_refused(hf_imported, tmp_path: Path, capsys,
                                                size: str) -> None:
    """It wrote one shard per tensor without a word."""
    _, imported = hf_imported("llama", False)
    refused(capsys, ["export-hf", str(imported), str(tmp_path / "out"), "--max-shard-bytes",
                        size], f"--max-shard-bytes {size} must be >= 1")
    assert not (tmp_path / "out").exists()
