"""The tests' torchrun stand-in (`tests.module_runs.run_module_ranks`): a port another process
holds between `free_port` and rank 0's store is a clean start on another port, not a hang."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests import module_runs

pytestmark = pytest.mark.slow  # two forked ranks: CI runs it, the quick lane leaves it


def test_a_taken_port_is_a_clean_start_on_another(tmp_path: Path, monkeypatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()  # rank 0's store cannot bind it; rank 1 would connect and wait
    given: list[int] = []
    original = module_runs.free_port

    def free_port() -> int:  # the held port first, then free ones
        given.append(original() if given else held.getsockname()[1])
        return given[-1]

    monkeypatch.setattr(module_runs, "free_port", free_port)
    try:
        runs = module_runs.run_module_ranks("tests.rendezvous", [], 2, tmp_path, timeout=120)
    finally:
        held.close()
    assert len(given) == 2 and given[1] != given[0]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    assert sorted(r.stdout.strip() for r in runs) == ["rank 0 sum 3", "rank 1 sum 3"]

