"""Issue 14 item 6: the entry points print a user error as one `error:` line and exit 2 (every
rank under torchrun, rank 0 printing), the traceback only on request; bugs keep theirs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST
from trainer.entry import exits_on_user_error
from trainer.errors import UserError

pytestmark = pytest.mark.slow


def _run(module: str, args: list[str], cwd: Path, nproc: int = 1,
         **env: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("HYDRA_FULL_ERROR", "LONGCTX_DEBUG")} | env
    return subprocess.run(launcher + ["-m", module, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300)


def _assert_one_error_line(proc: subprocess.CompletedProcess, words: str) -> None:
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, output[-3000:]
    assert len(lines) == 1 and words in lines[0], output[-3000:]
    assert "Traceback" not in output and "HYDRA_FULL_ERROR" not in output, output[-3000:]


def test_train_user_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _run("trainer", FAST + ["hydra.run.dir=run", "trainer.global_batch_size=0"], tmp_path)
    _assert_one_error_line(proc, "trainer.global_batch_size=0")
    full = _run("trainer", FAST + ["hydra.run.dir=run2", "trainer.global_batch_size=0"],
                tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode != 0 and "Traceback" in full.stderr and "UserError" in full.stderr


def test_eval_and_build_data_user_errors(tmp_path: Path) -> None:
    proc = _run("trainer.eval", ["hydra.run.dir=eval", "logger=none",
                                 f"checkpoint.load={tmp_path / 'nope'}"], tmp_path)
    _assert_one_error_line(proc, "checkpoint.load=")
    (tmp_path / "empty.txt").write_text("")
    proc = _run("trainer.build_data", ["empty.txt", "--output-prefix", "ds"], tmp_path)
    _assert_one_error_line(proc, "no documents")


def test_under_torchrun_every_rank_exits_2_and_rank_0_prints_once(tmp_path: Path) -> None:
    proc = _run("trainer", FAST + ["hydra.run.dir=run", "+attention=[dca,chunked]"],
                tmp_path, nproc=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert [line for line in output.splitlines() if line.startswith("error: ")] == [
        "error: attention: dca and chunked are two core-attention kinds; select one "
        "(+attention=<kind>), optionally with head_gate, e.g. '+attention=[dca,head_gate]'"]
    # The ranks print no traceback; torchrun's own report names the first rank's exit code.
    assert "UserError" not in output and "exitcode  : 2" in output, output[-3000:]


def test_a_bug_keeps_its_traceback() -> None:
    @exits_on_user_error
    def buggy() -> None:
        raise KeyError("not the user's fault")

    @exits_on_user_error
    def mistaken() -> None:
        raise UserError("bad setting")

    with pytest.raises(KeyError):
        buggy()
    with pytest.raises(SystemExit) as info:
        mistaken()
    assert info.value.code == 2


@pytest.mark.parametrize(("module", "override", "words"), [
    ("trainer", "trainer.max_step=5", "Key 'max_step' not in 'TrainerConfig'"),
    ("trainer", "trainer.max_steps=abc", "'abc' of type 'str' could not be converted"),
    ("trainer", "+attention=dac", "Could not find 'attention/dac'"),
    ("trainer.eval", "model=gpt_7b", "Available options in 'model': gpt_125m"),
])
def test_config_composition_errors_are_one_line(tmp_path: Path, module: str, override: str,
                                                words: str) -> None:
    """A misspelt key, a wrong type or an unknown config group, found by Hydra's composition
    before any job runs: one `error:` line, exit 2, no directory written."""
    proc = _run(module, ["logger=none", override], tmp_path)
    _assert_one_error_line(proc, words)
    assert not any(tmp_path.iterdir())


def test_under_torchrun_a_setting_error_comes_first_and_is_torchruns_root_cause(
        tmp_path: Path) -> None:
    """Issue 30: checked before the process group forms (no run directory yet); torchrun's
    failure report names the error instead of pointing to its documentation."""
    proc = _run("trainer", FAST + ["hydra.run.dir=run", "trainer.lr=1e-5", "trainer.min_lr=1e-4"],
                tmp_path, nproc=2)
    # torchrun's own log lines and its OMP_NUM_THREADS banner aside, the error comes first
    ours = [line for line in proc.stderr.splitlines()
            if line.strip(" *") and not re.match(r"([WEI]\d{4} |Setting OMP_NUM_THREADS)", line)]
    assert ours[0].startswith("error: trainer.min_lr (0.0001) must be in [0, trainer.lr (1e-05)]")
    assert "traceback : error: trainer.min_lr" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
