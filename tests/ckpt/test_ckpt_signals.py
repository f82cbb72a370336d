"""`python -m ckpt reshape` and `import-hf` interrupted by a signal to their parent process only:
each stops its worker ranks, removes its temporary output and exits non-zero within seconds."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import alive
from tests.module_runs import ModuleRun, start_module

pytestmark = pytest.mark.slow


def workers_started(proc: ModuleRun, count: int, timeout: float = 120) -> list:
    """The processes of `proc`'s tree once `count` spawned workers are running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the command ended before its workers could be interrupted"
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
            if sum("spawn_main" in " ".join(p.cmdline()) for p in tree) >= count:
                return tree
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    raise TimeoutError("the workers did not start")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.ckpt.hf_models import save_hf

    return save_hf(tmp_path_factory.mktemp("hf") / "hf", "llama", tied=False)


@pytest.mark.parametrize("command, sig", [("reshape", signal.SIGINT), ("reshape", signal.SIGTERM),
                                          ("import-hf", signal.SIGTERM)])
def test_a_signal_to_the_parent_stops_everything_and_keeps_nothing(
        request: pytest.FixtureRequest, tmp_path: Path, command: str,
        sig: signal.Signals) -> None:
    out = tmp_path / "out"
    out.mkdir()
    src = request.getfixturevalue("root" if command == "reshape" else "hf_dir")
    # `python -m ckpt ...` forked from the preloaded server (its workers are spawned, new
    # interpreters, as always), in its own session: the signal reaches the parent only, not a
    # terminal's process group.
    proc = start_module("ckpt", [command, str(src), str(out / "dst"), "--target-tp", "2"],
                        tmp_path, new_session=True)
    tree: list = []
    try:
        tree = workers_started(proc, 2)
        time.sleep(1)  # the workers are importing or loading
        os.kill(proc.pid, sig)
        start = time.monotonic()
        output = "".join(proc.communicate(timeout=30))
        took = time.monotonic() - start
        assert proc.returncode == 128 + sig, output[-2000:]
        assert f"interrupted by {sig.name}" in output
        # workers get SIGTERM, then SIGKILL after 5 s; a loaded machine adds a few seconds
        assert took < 20, f"took {took:.1f} s to exit"
        assert sorted(p.name for p in out.iterdir()) == []  # no DST, no hidden .dst.tmp-*
        deadline = time.monotonic() + 3
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(tree) == [], [" ".join(p.cmdline())[:100] for p in alive(tree)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in alive(tree):
            p.kill()
