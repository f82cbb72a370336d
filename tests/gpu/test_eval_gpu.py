"""`trainer.eval` end to end on the GPU (its CPU tests cannot catch device mixing): a short
CUDA training, then every evaluation of the extrapolation driver's DCA runs, with the attention
probe, passkey, multi-key and perplexity by position, on the CUDA model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _NoSweep:
    mode = None


@pytest.mark.parametrize("attention", [
    [], ["+attention=dca", "attention.dca_chunk_size=64", "attention.dca_local_size=16",
         "attention.dca_scaling=yarn"], ["+extrapolation=yarn"]])
def test_eval_runs_every_measurement_on_the_gpu(run_training, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               attention: list[str]) -> None:
    from trainer import eval as eval_entry

    rows = run_training(["trainer.max_steps=2", "trainer.save_interval=2"])
    assert "mfu" in rows[-1]  # trained on the GPU (the CPU has no peak to compare with)
    monkeypatch.setattr(eval_entry.HydraConfig, "get", staticmethod(lambda: _NoSweep()))
    cfg = compose_config(attention + [
        "eval.multikey_trials=1", "eval.multikey_keys=2", "eval.lengths=[256]",
        f"checkpoint.load={tmp_path / 'run' / 'checkpoints'}", "eval.depths=[0.0,1.0]",
        "eval.passkey_trials=2", "eval.perplexity_windows=1", "eval.attention_queries=4",
        "logger=none"])
    out = tmp_path / "eval"
    out.mkdir()
    results = eval_entry.evaluate(cfg, out)
    assert [c["length"] for c in results["passkey"]] == [256, 256]
    assert [c["trials"] for c in results["multikey"]] == [1, 1]
    assert results["perplexity"][0]["perplexity"] > 1
    probed = results["attention_by_distance"][0]
    assert probed["length"] == 256 and len(probed["entropy"]) == 2
    assert all(sum(m) == pytest.approx(1.0) for m in probed["mass"])
