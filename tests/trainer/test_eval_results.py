"""eval.json is `EvalResults`: written and read back unchanged, both suites."""

from __future__ import annotations

from pathlib import Path

from trainer.evals.results import (
    AttentionPoint,
    EvalResults,
    MultiKeyCell,
    PasskeyCell,
    PerplexityPoint,
    PositionBucket,
)
from trainer.evals.ruler import SuiteResult, TaskScore

COMMON = dict(checkpoint="ckpt/iter_0000001", step=1, trained_attention="standard",
              attention={"kind": "dca", "dca_chunk_size": 48}, label="dca", rope={},
              trained_length=64)


def test_the_passkey_suite_round_trips(tmp_path: Path) -> None:
    results = EvalResults(
        **COMMON, passkey=[PasskeyCell(64, 0.5, 3, 4)],
        multikey=[MultiKeyCell(64, 0.5, 1, 2, 4, 3)],
        perplexity=[PerplexityPoint(128, 2.0, 1, [PositionBucket(0, 64, 1.5, 64),
                                                  PositionBucket(64, 128, 2.5, 64)])],
        attention_by_distance=[AttentionPoint(128, [64, 127], [0, 64], [1.0], [[0.7, 0.3]])])
    path = results.write(tmp_path)
    assert EvalResults.read(path) == results
    written = path.read_text()
    assert '"accuracy": 0.75' in written and '"perplexity"' in written  # derived values too


def test_the_ruler_suite_round_trips(tmp_path: Path) -> None:
    results = EvalResults(**COMMON, suite="ruler", ruler=SuiteResult(
        [TaskScore("vt", 64, 40.0, 5)], {64: 40.0}, None, 85.6),
        ruler_settings={"tasks": ["vt"], "samples": 5, "template": "base", "seed": 0})
    assert EvalResults.read(results.write(tmp_path)) == results
    assert "passkey" not in results.to_dict()
