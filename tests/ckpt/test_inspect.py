"""`python -m ckpt inspect` shows what the model is: the settings its attention kind and RoPE
scaling use, not every field's default, and where an imported model came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt.inspect import attention_settings, describe, model_settings, print_description
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from tests.ckpt import hf_models
from tests.ckpt.longctx_models import write_variant

hf_imported = hf_models.hf_imported


def shown(root: Path, capsys: pytest.CaptureFixture) -> str:
    print_description(describe(Checkpoint(resolve_checkpoint(root))))
    return capsys.readouterr().out


def test_a_dca_model_shows_dca_settings_only(tmp_path: Path, capsys) -> None:
    out = shown(write_variant(tmp_path / "c", "dca-yarn-gated"), capsys)
    line = next(x for x in out.splitlines() if x.strip().startswith("attention"))
    assert "dca_chunk_size=16 dca_local_size=4" in line and "head_wise_attn_gate=True" in line
    assert "chunk_size=8192" not in line.replace("dca_chunk_size", "") and "kernel" not in line
    model = next(x for x in out.splitlines() if x.strip().startswith("model"))
    assert "rope_scaling_type=yarn rope_scaling_factor=4.0" in model.replace(
        "rope_original_max_position=16 ", "")
    assert "rope_low_freq_factor" not in model  # llama3's, not yarn's


def test_a_standard_imported_model_names_its_source(hf_imported, capsys) -> None:
    hf, root = hf_imported("qwen2", False)
    out = shown(root, capsys)
    assert f"imported from {hf}" in out and "(Qwen2ForCausalLM)" in out
    assert "\n  attention standard\n" in out
    assert "rope_beta_fast" not in out


def test_the_filters_keep_what_each_kind_uses() -> None:
    chunked = {"kind": "chunked", "chunk_size": 64, "global_layer_interval": 4,
               "dca_chunk_size": 8192, "head_wise_attn_gate": False}
    assert attention_settings(chunked) == {"chunk_size": 64, "global_layer_interval": 4}
    llama3 = {"rope_theta": 5e5, "rope_scaling_type": "llama3", "rope_scaling_factor": 8.0,
              "rope_original_max_position": 8192, "rope_low_freq_factor": 1.0,
              "rope_high_freq_factor": 4.0, "rope_beta_fast": 32.0, "num_layers": 2}
    assert set(model_settings(llama3)) == set(llama3) - {"rope_beta_fast"}
