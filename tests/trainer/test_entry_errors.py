"""The entry points print a user error as one `error:` line and exit 2 (every
rank under torchrun, rank 0 printing), the traceback only on request; bugs keep theirs.

A new interpreter per entry point (`python -m trainer`, `trainer.eval`, `trainer.build_data`
here; `trainer.generate` in test_generate.py, `python -m ckpt` in tests/ckpt/test_ckpt.py) and
one real torchrun job; the other cases run the same code in-process or forked from the
preloaded server (tests/conftest.py's `run_module`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST
from tests.module_runs import run_module
from trainer.entry import check_overrides, exits_on_user_error
from trainer.errors import UserError

NO_DEBUG = {"HYDRA_FULL_ERROR": None, "LONGCTX_DEBUG": None}


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


@pytest.mark.slow  # new interpreters
def test_train_user_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _run("trainer", FAST + ["hydra.run.dir=run", "trainer.global_batch_size=0"], tmp_path)
    _assert_one_error_line(proc, "trainer.global_batch_size=0")
    full = run_module("trainer", FAST + ["hydra.run.dir=run2", "trainer.global_batch_size=0"],
                      tmp_path, NO_DEBUG | {"HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr and "UserError" in full.stderr


@pytest.mark.slow  # new interpreters
def test_eval_and_build_data_user_errors(tmp_path: Path) -> None:
    proc = _run("trainer.eval", ["logger=none", "model=gpt_7b"], tmp_path)  # before Hydra runs
    _assert_one_error_line(proc, "Available options in 'model': gpt_125m")
    assert not any(tmp_path.iterdir())
    proc = run_module("trainer.eval", ["hydra.run.dir=eval", "logger=none",
                                       f"checkpoint.load={tmp_path / 'nope'}"], tmp_path, NO_DEBUG)
    _assert_one_error_line(proc, "checkpoint.load=")  # in the job
    (tmp_path / "empty.txt").write_text("")
    proc = _run("trainer.build_data", ["empty.txt", "--output-prefix", "ds"], tmp_path)
    _assert_one_error_line(proc, "no documents")


# Runs an entry point as `python -m MODULE ARGS` would, then prints its exit status and whether
# megatron was imported on the way
_IMPORT_PROBE = """
import json, runpy, sys
module, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "megatron": any(m.split(".")[0] == "megatron"
                                                for m in sys.modules)}))
"""


@pytest.mark.slow  # new interpreters
@pytest.mark.parametrize("module", ["trainer", "trainer.eval"])
def test_a_missing_checkpoint_is_refused_before_megatron_loads(tmp_path: Path,
                                                               module: str) -> None:
    """`checkpoint.load` naming nothing: one line, exit 2, before megatron's imports (seconds
    on a few cores) and before a run directory is made."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "LONGCTX_DEBUG")}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, module, "logger=none",
                           "checkpoint.load=nope"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    result = json.loads(proc.stdout.splitlines()[-1])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert result == {"code": 2, "megatron": False}, proc.stderr[-3000:]
    assert len(errors) == 1 and "checkpoint.load=nope: no such file" in errors[0], proc.stderr
    assert not any(tmp_path.iterdir())


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


@pytest.mark.parametrize(("override", "words"), [
    ("trainer.max_step=5", "Key 'max_step' not in 'TrainerConfig'"),
    ("trainer.max_steps=abc", "'abc' of type 'str' could not be converted"),
    ("+attention=dac", "Could not find 'attention/dac'"),
    ("model=gpt_7b", "Available options in 'model': gpt_125m"),
])
def test_config_composition_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch, override: str,
                                                words: str) -> None:
    """A misspelt key, a wrong type or an unknown config group, found by Hydra's composition
    before any job runs (`check_overrides`, which `python -m trainer` and `trainer.eval` call
    first; the command lines: test_eval_and_build_data_user_errors): one `error:` line, exit 2,
    no directory written."""
    for name in NO_DEBUG:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        check_overrides(["logger=none", override])
    out = capsys.readouterr()
    _assert_one_error_line(subprocess.CompletedProcess([], exit_.value.code, out.out, out.err),
                           words)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("overrides", "words"), [
    # a value outside a choice (a run setting, the model's attention): the choices listed
    (["trainer.attention_kernel=fast"],
     "trainer.attention_kernel='fast' must be one of auto, fa4, cudnn, flash, math"),
    (["+attention=dca", "trainer.dca_backward=fast"],
     "trainer.dca_backward='fast' must be one of auto, one_piece, parts"),
    (["attention.kind=ring"], "attention.kind='ring' must be one of standard, dca, chunked"),
    (["+attention=dca", "attention.dca_scaling=cubic"],
     "attention.dca_scaling='cubic' must be one of none, log, yarn"),
    (["+attention=dca", "attention.dca_scaling_parts=intra"],
     "attention.dca_scaling_parts='intra' must be one of all, succ_inter, inter"),
    (["trainer.recompute=sometimes"],
     "trainer.recompute='sometimes' must be one of none, selective, full"),
    (["trainer.precision=fp8"], "trainer.precision='fp8' must be one of auto, bf16, fp32"),
    (["eval.suite=other"], "eval.suite='other' must be one of passkey, ruler"),
    # a run setting under the name it had in the attention group: the new name
    (["attention.kernel=fa4"], "attention.kernel is now trainer.attention_kernel: how a run runs "
                               "the model, not what the model is"),
    (["attention.kernel=fa4"], "set trainer.attention_kernel=fa4 instead"),
    (["+attention=dca", "attention.dca_backward=parts"],
     "attention.dca_backward is now trainer.dca_backward"),
    (["+attention=dca", "+attention.dca_keep_rotated=true"],
     "set trainer.dca_keep_rotated=true instead"),
])
def test_choices_and_moved_settings_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 overrides: list[str], words: str) -> None:
    """Every choice is an Enum that Hydra checks when it composes the config: a value outside it
    is one line naming the setting, the value and the choices; a setting typed under its old
    name (before it moved from `attention` to the run's `trainer` group) names the new one,
    instead of Hydra's report that the attention group has no such key."""
    for name in NO_DEBUG:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        check_overrides(["logger=none", *overrides])
    out = capsys.readouterr()
    _assert_one_error_line(subprocess.CompletedProcess([], exit_.value.code, out.out, out.err),
                           words)
    assert "Could not" not in out.err and "AttentionConfig" not in out.err
    assert not any(tmp_path.iterdir())


def test_an_old_name_in_a_config_file_names_the_new_one() -> None:
    """An old name that reaches the composed config some other way (appended, or from a config
    file of one's own) is refused naming the new one too (`check_known_keys`)."""
    from tests.conftest import compose_config
    from trainer.config import check_known_keys

    cfg = compose_config(["+attention=dca", "+attention.dca_backward=parts"])
    with pytest.raises(UserError, match="attention.dca_backward is now trainer.dca_backward: .*"
                                        "set trainer.dca_backward=parts instead"):
        check_known_keys(cfg)


@pytest.mark.slow  # torchrun: three new interpreters
def test_under_torchrun_every_rank_exits_2_rank_0_prints_once_and_torchrun_names_it(
        tmp_path: Path) -> None:
    """Checked before the process group forms (no run directory yet): every rank exits 2, rank
    0 prints the error first (torchrun's own log lines and its OMP_NUM_THREADS banner aside), no
    rank a traceback, and torchrun's failure report names the error (its root cause) instead of
    pointing to its documentation."""
    proc = _run("trainer", FAST + ["hydra.run.dir=run", "+attention=[dca,chunked]"],
                tmp_path, nproc=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = ("error: attention: dca and chunked are two core-attention kinds; select one "
               "(+attention=<kind>), optionally with head_gate, e.g. '+attention=[dca,head_gate]'")
    assert [line for line in output.splitlines() if line.startswith("error: ")] == [message]
    ours = [line for line in proc.stderr.splitlines()
            if line.strip(" *") and not re.match(r"([WEI]\d{4} |Setting OMP_NUM_THREADS)", line)]
    assert ours[0] == message, proc.stderr[-3000:]
    assert "UserError" not in output and "exitcode  : 2" in output, output[-3000:]
    assert f"traceback : {message[:40]}" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
