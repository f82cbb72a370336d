"""Training-free context extension shipped at export (`export-hf --attention dca`,
`--rope-scaling`): the export loads in transformers and computes the trainer's logits for the
same settings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ckpt.hf_config import HFError
from ckpt.hf_export import Extension, export_hf
from ckpt.load import load_model_weights
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from models.gpt import build_model
from models.schema import AttentionConfig, ParallelConfig
from parallel.distributed import initialize_parallel, shutdown
from tests.ckpt import hf_models

hf_imported = hf_models.hf_imported
OWN = 64  # hf_models' max_position_embeddings: the model's own length T
TOKENS = torch.randint(0, hf_models.VOCAB, (2, 4 * OWN),
                       generator=torch.Generator().manual_seed(5))


def trainer_logits(root: Path, attention: AttentionConfig, **rope) -> torch.Tensor:
    ckpt = resolve_checkpoint(root)
    meta = Checkpoint(ckpt).meta
    initialize_parallel(torch.device("cpu"), tp=1, seed=0)
    try:
        built = build_model(replace(meta.model, **rope), attention, ParallelConfig(),
                            vocab_size=meta.vocab_size, max_sequence_length=TOKENS.shape[1])
        load_model_weights(ckpt, built.gpt)
        with torch.no_grad():
            out = built.gpt.eval()(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS), None)
    finally:
        shutdown()
    return out[..., :hf_models.VOCAB]


def hf_logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def test_dca_added_at_export_runs_as_the_trainer_runs_it(hf_imported, tmp_path: Path) -> None:
    _, root = hf_imported("qwen2", False)
    export_hf(root, tmp_path / "hf", extension=Extension(attention="dca"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # ChunkLlama's split of T: chunk 3T/4, local window T/16; 4T recorded as the length
    assert (config["longctx"]["dca_chunk_size"], config["longctx"]["dca_local_size"]) == (48, 4)
    assert config["longctx"]["original_max_position_embeddings"] == OWN
    assert config["max_position_embeddings"] == 4 * OWN
    dca = AttentionConfig(kind="dca", dca_chunk_size=48, dca_local_size=4)
    ours, theirs = trainer_logits(root, dca), hf_logits(tmp_path / "hf")
    assert (ours - theirs).abs().max().item() <= 1e-4
    standard = trainer_logits(root, AttentionConfig())
    assert (standard - theirs).abs().max().item() > 1e-3  # 10x the tolerance: not standard


def test_dca_with_its_log_scaling_added_at_export(hf_imported, tmp_path: Path) -> None:
    """`--dca-scaling log`: Llama 4's temperature from the model's length T on (floor_scale T),
    the trainer's logits over 4T (the factors differ from 1 past T)."""
    _, root = hf_imported("qwen2", False)
    export_hf(root, tmp_path / "hf", extension=Extension(attention="dca", dca_scaling="log"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())["longctx"]
    assert (settings["dca_scaling"], settings["dca_scaling_floor_scale"]) == ("log", OWN)
    dca = AttentionConfig(kind="dca", dca_chunk_size=48, dca_local_size=4)
    scaled = replace(dca, dca_scaling="log", dca_scaling_floor_scale=OWN)
    ours, theirs = trainer_logits(root, scaled), hf_logits(tmp_path / "hf")
    # this small model's logits move 4e-4 with the factors (<= 1.14 at 4T): the export must
    # match to 1e-5, a tenth of that
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (trainer_logits(root, dca) - theirs).abs().max().item() > 1e-4


@pytest.mark.parametrize("kind", ["yarn", "linear", "ntk"])
def test_rope_scaling_added_at_export_runs_in_plain_transformers(hf_imported, tmp_path: Path,
                                                                 kind: str) -> None:
    _, root = hf_imported("qwen2", False)
    export_hf(root, tmp_path / "hf", extension=Extension(rope_scaling=kind, rope_factor=4.0))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "auto_map" not in config and config["max_position_embeddings"] == 4 * OWN
    ours = trainer_logits(root, AttentionConfig(), rope_scaling_type=kind,
                          rope_scaling_factor=4.0, rope_original_max_position=OWN)
    theirs = hf_logits(tmp_path / "hf")
    assert (ours - theirs).abs().max().item() <= 1e-4
    plain = trainer_logits(root, AttentionConfig())
    assert (plain - theirs).abs().max().item() > 1e-3


@pytest.mark.parametrize(("chunk", "local"), [(32, 4), (4, 1)])
def test_a_chosen_chunk_gets_the_local_window_the_trainer_gives(hf_imported, tmp_path: Path,
                                                                chunk: int, local: int) -> None:
    """`--dca-chunk-size` alone: the split's window T/16 while it is below the chunk, else a
    twelfth of the chunk, as `python -m trainer.eval +attention=dca attention.dca_chunk_size=C`
    adopts it on the same model."""
    from omegaconf import OmegaConf

    from trainer.defaults import adopt_dca_split

    _, root = hf_imported("qwen2", False)
    export_hf(root, tmp_path / "hf", extension=Extension(attention="dca", dca_chunk_size=chunk))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())["longctx"]
    adopted = OmegaConf.create({"kind": "dca", "dca_chunk_size": chunk, "dca_local_size": 0})
    adopt_dca_split(adopted, "standard", (0, 0), OWN, {"dca_chunk_size"})
    assert (settings["dca_chunk_size"], settings["dca_local_size"]) == (chunk, local)
    assert (adopted.dca_chunk_size, adopted.dca_local_size) == (chunk, local)


@pytest.mark.parametrize(("extension", "message"), [
    (Extension(attention="dca", rope_scaling="yarn"), "choose one extension"),
    (Extension(dca_chunk_size=32), "need --attention dca"),
    (Extension(dca_scaling="log"), "need --attention dca"),
    (Extension(attention="dca", dca_chunk_size=8, dca_local_size=8), "below --dca-chunk-size"),
    (Extension(rope_scaling="yarn", rope_factor=0.5), "must be above 1"),
])
def test_bad_extensions_are_refused(hf_imported, tmp_path: Path, extension: Extension,
                                    message: str) -> None:
    _, root = hf_imported("qwen2", False)
    with pytest.raises(HFError, match=message):
        export_hf(root, tmp_path / "hf", extension=extension)
    assert not (tmp_path / "hf").exists()


def test_rope_scaling_on_a_model_that_already_scales_is_refused(hf_imported,
                                                               tmp_path: Path) -> None:
    _, root = hf_imported("llama-yarn", False)
    with pytest.raises(HFError, match="already scales RoPE"):
        export_hf(root, tmp_path / "hf", extension=Extension(rope_scaling="ntk"))
