"""`data.read_ahead`: the next step's micro-batches are read while the backward is queued (before
the step's first host sync), and the batches, hence the losses, are those of reading inline."""

from __future__ import annotations

import pytest

import trainer.step
from trainer.data.datasets import DataIterator


@pytest.fixture
def order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """'read' per micro-batch read, 'sync' when a step reads its loss back (after the optimizer)."""
    seen: list[str] = []
    read, mean = DataIterator.__next__, trainer.step._mean_over_data_parallel

    def reading(self: DataIterator) -> dict:
        seen.append("read")
        return read(self)

    def syncing(value):  # type: ignore[no-untyped-def]
        seen.append("sync")
        return mean(value)

    monkeypatch.setattr(DataIterator, "__next__", reading)
    monkeypatch.setattr(trainer.step, "_mean_over_data_parallel", syncing)
    return seen


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_next_batches_are_read_before_the_step_syncs(run_training, order: list[str]) -> None:
    # micro-batch 4, global batch 8: two micro-batches per step
    ahead = run_training(["trainer.max_steps=4", "trainer.global_batch_size=8"], name="ahead")
    assert order == ["read"] * 4 + ["sync", "read", "read"] * 3 + ["sync"]
    order.clear()
    inline = run_training(["trainer.max_steps=4", "trainer.global_batch_size=8",
                           "data.read_ahead=false"], name="inline")
    assert order == ["read", "read", "sync"] * 4
    assert [r["loss"] for r in ahead] == [r["loss"] for r in inline]
    assert len({r["loss"] for r in ahead}) == 4  # four different batches
