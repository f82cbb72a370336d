"""The run directory: one run at a time, unique default names, no mixing with old checkpoints.

Real `python -m trainer` processes (forked from the preloaded server, `start_module`): the
lock must hold across processes and die with them.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ckpt.paths import TRACKER
from tests.conftest import FAST, read_metrics
from tests.module_runs import ModuleRun, run_module_ranks, start_module

pytestmark = pytest.mark.slow

TINY = FAST + ["trainer.max_steps=2", "data.max_documents=20"]


def _start(args: list[str], cwd: Path) -> ModuleRun:
    return start_module("trainer", args, cwd)


def _finish(proc: ModuleRun, rc: int = 0) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rc, f"rc {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    return err


def test_jobs_started_together_get_their_own_default_directories(tmp_path: Path) -> None:
    procs = [_start(TINY + ["checkpoint.save=false"], tmp_path) for _ in range(2)]
    for proc in procs:
        _finish(proc)
    dirs = sorted(tmp_path.glob("outputs/*/*"))
    # <date>/<time>-<pid>: the pid tells jobs of the same second apart.
    assert sorted(d.name.rsplit("-", 1)[1] for d in dirs) == sorted(str(p.pid) for p in procs)
    for d in dirs:
        assert [r["step"] for r in read_metrics(d)] == [1, 2]


def _snapshot(run_dir: Path) -> dict[str, bytes | float]:
    """Every file's bytes (the lock file aside: it names its latest holder)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def test_a_held_directory_is_refused_until_its_holder_dies(tmp_path: Path) -> None:
    holder = _start(FAST + ["trainer.max_steps=100000", "trainer.save_interval=0",
                            "hydra.run.dir=run"], tmp_path)
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # the holder is training
            assert holder.poll() is None and time.monotonic() < deadline, holder.output()
            time.sleep(0.5)
        before = _snapshot(run_dir)
        err = _finish(_start(TINY + ["hydra.run.dir=run"], tmp_path), rc=2)
        assert err.strip().splitlines()[-1].startswith("error:") and "Traceback" not in err
        assert f"pid {holder.pid} on" in err and "hydra.run.dir" in err
        after = _snapshot(run_dir)  # the holder's .hydra/ as it was; its log only grew
        assert {k: v for k, v in after.items() if k.startswith(".hydra")} == {
            k: v for k, v in before.items() if k.startswith(".hydra")}
        assert after["train.log"].startswith(before["train.log"])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
    # SIGKILL released the lock: the next run takes the directory.
    _finish(_start(TINY + ["hydra.run.dir=run", "checkpoint.save=false"], tmp_path))
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


def test_rerunning_a_finished_directory_needs_load_or_overwrite(tmp_path: Path) -> None:
    _finish(_start(TINY + ["hydra.run.dir=run", "trainer.save_interval=1"], tmp_path))
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    before = _snapshot(run_dir)
    err = _finish(_start(TINY + ["hydra.run.dir=run"], tmp_path), rc=2)
    assert "checkpoint.overwrite=true" in err and f"checkpoint.load={root}" in err
    assert _snapshot(run_dir) == before  # tracker, iter_*, .hydra/ and the log untouched
    assert (root / TRACKER).read_text().strip() == "2"

    # Resuming an older checkpoint of the same directory would mix two histories.
    err = _finish(_start(TINY + ["hydra.run.dir=run", "trainer.max_steps=3",
                                 f"checkpoint.load={root / 'iter_0000001'}"], tmp_path), rc=2)
    assert "checkpoint.overwrite=true" in err and _snapshot(run_dir) == before

    # overwrite: the old checkpoints go, so the tracker never points back among stale ones.
    _finish(_start(TINY + ["hydra.run.dir=run", "trainer.max_steps=3",
                           "checkpoint.overwrite=true"], tmp_path))
    # (run.lock: the run locks its checkpoint.dir inside its run directory too, ckpt/lock.py)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000003", TRACKER, "run.lock"]
    assert (root / TRACKER).read_text().strip() == "3"


def test_every_rank_refuses_a_held_directory(tmp_path: Path) -> None:
    """Two ranks as torchrun starts them (torchrun's own report of an exit 2:
    test_entry_errors.py)."""
    holder = start_module("tests.trainer.holder", ["run"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while holder.output()[0].strip() != "held":
            assert holder.poll() is None and time.monotonic() < deadline, holder.output()
            time.sleep(0.1)
        ranks = run_module_ranks("trainer", TINY + ["trainer.micro_batch_size=2",
                                                    "hydra.run.dir=run"], 2, tmp_path)
    finally:
        holder.kill()
        holder.wait(60)
    # Every rank refuses (trainer/entry.py: they leave together with exit 2); rank 0 prints.
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr[-2000:] for r in ranks]
    refusals = [[line for line in r.stderr.splitlines() if line.startswith("error: run directory")]
                for r in ranks]
    assert len(refusals[0]) == 1 and not refusals[1], ranks[0].stderr[-2000:]
    assert f"pid {holder.pid} on" in refusals[0][0]
