"""Attacks on `python -m trainer.eval`'s run directory: pointed at
a training run's directory, it overwrote that run's `.hydra/config.yaml` and `overrides.yaml`.
It now holds its own run directory (the lock every writer honours, `ckpt.lock`) and refuses one
holding another job's outputs, before Hydra writes anything there. The next attack on
`trainer.eval` starts here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.module_runs import run_module
from trainer.run_dir import RunDirError, check_not_another_jobs


def _training_run(run_dir: Path) -> dict[str, bytes]:
    """What a finished `python -m trainer` leaves in its run directory (the parts at stake)."""
    (run_dir / ".hydra").mkdir(parents=True)
    files = {".hydra/config.yaml": b"trainer:\n  max_steps: 60\n",
             ".hydra/overrides.yaml": b"- trainer.max_steps=60\n",
             ".hydra/hydra.yaml": b"hydra:\n  job:\n    name: train\n",
             "train.log": b"step 1/60\n"}
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
    return files


def test_a_training_runs_directory_is_refused(tmp_path: Path) -> None:
    _training_run(tmp_path / "run")
    with pytest.raises(RunDirError, match=r"holds another job's outputs \(.hydra/, train.log: a "
                                          r"training run's\?\).* choose another hydra.run.dir"):
        check_not_another_jobs(tmp_path / "run", "eval")
    (tmp_path / "again" / ".hydra").mkdir(parents=True)  # an earlier evaluation's directory
    (tmp_path / "again" / "eval.log").write_text("")
    check_not_another_jobs(tmp_path / "again", "eval")
    check_not_another_jobs(tmp_path / "new", "eval")


@pytest.mark.slow  # a training run and the command line: CI runs it
def test_eval_into_a_training_runs_directory_keeps_its_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    files = _training_run(run_dir)
    # a path that exists (the entry point refuses a missing one first), never read: the
    # directory is refused before the checkpoint is opened
    proc = run_module("trainer.eval", [f"checkpoint.load={tmp_path}", "logger=none",
                                       f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: hydra.run.dir={run_dir} holds another job's outputs")
    assert {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file()} == files  # nothing written, nothing replaced
