"""The checkpoint tool's command line run in this process, for the tests of its refusals."""

from __future__ import annotations

import pytest

from ckpt.__main__ import main


def refused(capsys: pytest.CaptureFixture, argv: list[str], *words: str) -> str:
    """`python -m ckpt ARGV` exits 2 with one `error:` line (`warning:` lines aside: no
    traceback, no worker's report) holding every one of `words`; returns its stderr."""
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], err
    return err
