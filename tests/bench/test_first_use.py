"""bench/first_use.py's rows from bench/train.py's result: the first step's extra over the
median step after the warm-up."""

from __future__ import annotations

from bench import first_use


def test_row_and_table_from_a_train_result() -> None:
    result = {"warmup_steps_s": [31.5, 1.25], "step_s": 1.0}
    row = first_use.row("dca", "fa4", "empty", 95.0, result)
    assert row["first_step_extra_s"] == 30.5 and row["process_s"] == 95.0
    table = first_use.markdown([row])
    assert "| dca (fa4) | empty | 95.0 | 31.50 / 1.25 | 1.000 | 30.5 |" in table
