"""Attacks through the working directory: a `conf/` folder or `conf` package there must not
shadow the trainer's own configs. Start the next attack here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# What `python -c` in the working directory sees first on sys.path: the working directory.
_ROPE_THETA = ("from trainer.rope_override import default_model; "
               "print(default_model().rope_theta)")


def _in(cwd: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("package", [False, True], ids=["folder", "package"])
def test_a_conf_of_the_working_directory_does_not_shadow_ours(tmp_path: Path,
                                                              package: bool) -> None:
    ours = _in(REPO, _ROPE_THETA)
    assert ours.returncode == 0, ours.stderr
    model = tmp_path / "conf" / "model"
    model.mkdir(parents=True)
    (model / "tiny.yaml").write_text("rope_theta: 1.5\n")
    if package:  # an importable `conf` whose model/tiny.yaml would silently win
        (tmp_path / "conf" / "__init__.py").write_text("")
    theirs = _in(tmp_path, _ROPE_THETA)
    assert theirs.returncode == 0, theirs.stderr  # a folder: TypeError from conf.__file__ before
    assert theirs.stdout == ours.stdout != "1.5\n"
