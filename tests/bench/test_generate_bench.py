"""bench/generate.py runs end to end on a CPU with tiny settings (GPU: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.generate import bench, parse_args


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_generation_benchmark_runs_tiny_on_the_cpu(tmp_path) -> None:
    args = parse_args(["--model", "tiny", "--vocab", "512", "--prefill", "40", "--decode", "6",
                       "--dca-chunk", "16", "--dca-local", "4", "--device", "cpu", "--dtype",
                       "fp32", "--recompute", "3", "--batch", "1,3", "--static-cache", "--tmp",
                       str(tmp_path)])
    rows = bench(args)
    assert [r["variant"] for r in rows] == ["trainer", "trainer_b3", "trainer_recompute",
                                            "remote", "remote_static", "hf_standard"]
    for row in rows:
        assert row["prefill_s"] > 0 and row["decode_tok_s"] > 0 and 0 <= row["agree"] <= 6
    # the engine decodes as recomputation, alone and in a batch; so does the remote code
    assert [r["agree"] for r in rows[:5]] == [6, 6, 3, 6, 6]
    assert not list(tmp_path.iterdir())  # checkpoints and exports removed
