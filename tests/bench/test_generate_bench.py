"""bench/generate.py runs end to end on a CPU with tiny settings (GPU: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.generate import bench, parse_args


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_generation_benchmark_runs_tiny_on_the_cpu(tmp_path) -> None:
    args = parse_args(["--model", "tiny", "--vocab", "512", "--prefill", "40", "--decode", "6",
                       "--dca-chunk", "16", "--dca-local", "4", "--device", "cpu", "--dtype",
                       "fp32", "--recompute", "3", "--tmp", str(tmp_path)])
    rows = bench(args)
    assert [r["variant"] for r in rows] == ["trainer", "trainer_recompute", "remote",
                                            "hf_standard"]
    for row in rows:
        assert row["prefill_s"] > 0 and row["decode_tok_s"] > 0 and 0 <= row["agree"] <= 6
    assert rows[0]["agree"] == 6 and rows[1]["agree"] == 3  # the cache decodes as recomputation
    assert not list(tmp_path.iterdir())  # checkpoints and exports removed
