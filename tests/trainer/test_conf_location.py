"""The installed configs are found by their location, whatever the working
directory holds; a Hydra project's own `conf/` there must not shadow them."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ckpt", "conf", "models", "parallel", "trainer")


def _decoy(tmp_path: Path, regular_package: bool) -> Path:
    """A working directory holding another project's `conf/` (with or without __init__.py)."""
    work = tmp_path / "project"
    (work / "conf").mkdir(parents=True)
    (work / "conf" / "config.yaml").write_text("decoy: true\n")
    if regular_package:
        (work / "conf" / "__init__.py").write_text("")
    return work


def _assert_trainer_config(proc: subprocess.CompletedProcess) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "seq_length:" in proc.stdout and "decoy" not in proc.stdout, output[-3000:]


def test_decoy_conf_package_in_the_working_directory(tmp_path: Path) -> None:
    """The checkout on PYTHONPATH (as a regular install's site-packages): the working
    directory comes first on sys.path under `python -m`, so its `conf` package would win."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "trainer", "--cfg", "job"],
                          cwd=_decoy(tmp_path, regular_package=True), env=env,
                          capture_output=True, text=True, timeout=300)
    _assert_trainer_config(proc)


def test_editable_install_with_a_decoy_conf_directory(tmp_path: Path) -> None:
    """An editable install as `pip install -e .` makes it (setuptools' finder, appended to
    sys.meta_path, maps each top-level package to this checkout): a plain `conf/` directory in
    the working directory is a namespace package that the path finder returns first."""
    editable_wheel = pytest.importorskip("setuptools.command.editable_wheel")
    site = tmp_path / "site"
    site.mkdir()
    mapping = {name: str(ROOT / name) for name in PACKAGES}
    (site / "longctx_test_finder.py").write_text(
        editable_wheel._finder_template("longctx-test", mapping, {}))
    bootstrap = ("import runpy, longctx_test_finder; longctx_test_finder.install(); "
                 "runpy.run_module('trainer', run_name='__main__', alter_sys=True)")
    # -S: no site processing, so the venv's own editable finder (if any) is not installed;
    # the dependencies come from site-packages on PYTHONPATH, this checkout only via the finder.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site),
                                                       sysconfig.get_paths()["purelib"]])}
    proc = subprocess.run([sys.executable, "-S", "-c", bootstrap, "--cfg", "job"],
                          cwd=_decoy(tmp_path, regular_package=False), env=env,
                          capture_output=True, text=True, timeout=300)
    _assert_trainer_config(proc)
    assert str(ROOT / "trainer") in subprocess.run(
        [sys.executable, "-S", "-c", bootstrap.split(";")[0] + "; longctx_test_finder.install(); "
         "import trainer; print(trainer.__file__)"], cwd=tmp_path / "project", env=env,
        capture_output=True, text=True, timeout=60).stdout
