"""Hostile inputs and signals for `python -m trainer.build_data`.

An output prefix naming a directory (`o/` wrote the hidden `o/.bin`), a prefix under a file, a
JSONL document holding a lone surrogate (a traceback from the tokenizer) end as one `error:`
line before any output; SIGTERM removes the `PREFIX.bin.tmp-PID` it was writing; a FIFO is named
as not a regular file (not as missing), a full disk in one line with nothing left. The next
attacker of build_data starts here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path

import pytest

from trainer.build_data import main


def _refused(capsys: pytest.CaptureFixture, argv: list[str], *words: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], err


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The grass is green. " * 20)
    return tmp_path / "doc.txt"


@pytest.mark.parametrize("prefix", ["o/", "o/.", "o/.."])
def test_a_prefix_naming_a_directory_is_refused(corpus: Path, capsys, prefix: str) -> None:
    _refused(capsys, [str(corpus), "--output-prefix", prefix], f"--output-prefix {prefix}")
    assert not (corpus.parent / "o").exists()


def test_a_prefix_under_a_file_is_refused(corpus: Path, capsys) -> None:
    _refused(capsys, [str(corpus), "--output-prefix", f"{corpus}/sub/ds"],
             f"under the file {corpus}")


def test_a_lone_surrogate_names_the_file_and_line(corpus: Path, capsys) -> None:
    jsonl = corpus.parent / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "abc \\ud800 def"}\n')
    _refused(capsys, [str(jsonl), "--output-prefix", "ds"], f"{jsonl}:2", "surrogate")
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["doc.txt", "docs.jsonl"]


def _terminated(cwd: str, err: str) -> None:
    """In a forked child: build_data, which sends itself SIGTERM while it reads its first
    document, after its temporary PREFIX.bin.tmp-PID exists; stderr to `err`."""
    import trainer.build_data as bd

    os.chdir(cwd)
    target = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's capture
    read = bd._documents

    def documents(path, *args):  # noqa: ANN001, ANN002, ANN202
        assert list(Path.cwd().glob("ds.bin.tmp-*")), "the temporary .bin should exist by now"
        os.kill(os.getpid(), signal.SIGTERM)
        yield from read(path, *args)
    bd._documents = documents
    code = bd.main(["doc.txt", "--output-prefix", "ds"])
    sys.stderr.flush()
    os._exit(code)


def test_sigterm_removes_the_temporary_files(corpus: Path, tmp_path_factory) -> None:
    """In a process of its own (a fork of this one): its signal handlers are its own."""
    err = tmp_path_factory.mktemp("stderr") / "stderr"
    proc = mp.get_context("fork").Process(target=_terminated, args=(str(corpus.parent), str(err)))
    proc.start()
    proc.join(300)
    stderr = err.read_text()
    assert proc.exitcode == 143, (proc.exitcode, stderr[-2000:])
    assert "error: interrupted by SIGTERM; nothing was written" in stderr, stderr
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["doc.txt"]


@pytest.mark.parametrize("how", ["input", "files-from"])
def test_a_fifo_is_named_as_not_a_regular_file(corpus: Path, capsys, how: str) -> None:
    """Before: `input files not found` for a FIFO that is there."""
    fifo = corpus.parent / "fifo"
    os.mkfifo(fifo)
    argv = [str(fifo)] if how == "input" else ["--files-from", str(fifo)]
    _refused(capsys, [*argv, "--output-prefix", "ds"], f"{fifo} is not a regular file",
             "a FIFO or pipe")
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["doc.txt", "fifo"]


def test_a_full_disk_is_one_line_and_leaves_nothing(corpus: Path, capsys,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `OSError: [Errno 28] No space left on device` with a traceback."""
    import errno

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    def full(self, tensor) -> None:
        self.data_file.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(IndexedDatasetBuilder, "add_item", full)
    _refused(capsys, [str(corpus), "--output-prefix", "ds"],
             "no space left on device (ENOSPC) while writing ds.bin/.idx",
             "the partial files were removed")
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["doc.txt"]
