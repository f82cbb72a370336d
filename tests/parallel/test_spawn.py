"""The tests' multi-process helper (tests/conftest.py `spawn`) survives a port taken between
choosing it and binding it, as happens when another test's processes start at the same time."""

from __future__ import annotations

import socket

import pytest

from tests import conftest


def _rank_count(expected: int) -> None:
    import torch.distributed as dist

    assert dist.get_world_size() == expected


@pytest.mark.slow  # a forkserver and two gloo processes: CI runs it, the quick lane leaves it
def test_spawn_takes_another_port_when_its_port_is_taken(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]  # the first port offered is in use
        free = conftest.free_port
        monkeypatch.setattr(conftest, "free_port", lambda: ports.pop() if ports else free())
        conftest.spawn(_rank_count, 2, world=2, tp=None)
        assert not ports
