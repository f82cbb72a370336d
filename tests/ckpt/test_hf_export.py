"""`python -m ckpt export-hf`, the round trip, sharded inputs and refused inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt.__main__ import main
from ckpt.hf_export import export_hf
from ckpt.hf_import import import_hf
from tests.ckpt import hf_models
from tests.ckpt.hf_models import VOCAB, hf_logits, save_hf

hf_imported = hf_models.hf_imported  # the shared fixture
TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_export_import_export_is_bitwise(tmp_path: Path, hf_imported) -> None:
    hf, imported = hf_imported("llama", False, 2)
    # From TP=2, sharded (an index) by a small shard limit: the next import reads an index.
    export_hf(imported, tmp_path / "out1", max_shard_bytes=100_000)
    assert (tmp_path / "out1" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "out1").glob("*.safetensors"))) > 1
    torch.testing.assert_close(hf_logits(tmp_path / "out1", TOKENS), hf_logits(hf, TOKENS),
                               rtol=0, atol=0)
    import_hf(tmp_path / "out1", tmp_path / "ckpt2", 1)
    export_hf(tmp_path / "ckpt2", tmp_path / "out2")
    first, second = tensors(tmp_path / "out1"), tensors(tmp_path / "out2")
    assert first.keys() == second.keys() == tensors(hf).keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    config = json.loads((tmp_path / "out2" / "config.json").read_text())
    assert config == json.loads((tmp_path / "out1" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config


def test_a_mistral_exports_as_mistral(tmp_path: Path, hf_imported) -> None:
    hf, imported = hf_imported("mistral", True)
    export_hf(imported, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] is None
    torch.testing.assert_close(hf_logits(tmp_path / "out", TOKENS), hf_logits(hf, TOKENS),
                               rtol=0, atol=0)


def _sharded(tmp_path: Path) -> Path:
    return save_hf(tmp_path / "hf", "qwen2", tied=False, max_shard_size="50KB")


def _missing_shard(hf: Path) -> str:
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    shard.unlink()
    return shard.name


def _wrong_dtype(hf: Path) -> str:
    shard = sorted(hf.glob("model-*.safetensors"))[0]
    with safe_open(shard, "pt") as f:
        data = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    name = sorted(data)[0]
    data[name] = data[name].to(torch.int32)
    save_file(data, shard, metadata={"format": "pt"})
    return shard.name


def _unknown_architecture(hf: Path) -> str:
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    return "config.json"


def _mismatched_shape(hf: Path) -> str:
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (hf / "config.json").write_text(json.dumps(cfg))
    return "mlp.gate_proj.weight has shape [96, 64]"


@pytest.mark.parametrize("damage", [_missing_shard, _wrong_dtype, _unknown_architecture,
                                    _mismatched_shape])
def test_bad_input_is_refused_naming_the_file(tmp_path: Path, capsys, damage) -> None:
    hf = _sharded(tmp_path)
    named = damage(hf)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["import-hf", str(hf), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err, err
    assert not (tmp_path / "ckpt").exists()


def test_a_tp_the_model_cannot_split_over_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    hf = _sharded(tmp_path)
    capsys.readouterr()
    assert main(["import-hf", str(hf), str(tmp_path / "ckpt"), "--target-tp", "3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "model.num_attention_heads (4) is not divisible by 3" in err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_trainer_checkpoints_export_their_real_vocabulary_length_and_gate(
        tmp_path: Path, run_training, hf_imported, capsys) -> None:
    """A byte-tokenizer run exports 257 rows; a fine-tune of an imported model (on its own
    tokenizer, at a shorter length) exports the model's vocabulary and context length, loads in
    transformers and copies the tokenizer; a head-gated fine-tune exports with its gate (remote
    code)."""
    from transformers import AutoModelForCausalLM

    run_training(["trainer.max_steps=2", "trainer.save_interval=2"], name="byte")
    export_hf(tmp_path / "byte" / "checkpoints", tmp_path / "byte_hf")
    assert json.loads((tmp_path / "byte_hf" / "config.json").read_text())["vocab_size"] == 257
    assert tensors(tmp_path / "byte_hf")["model.embed_tokens.weight"].shape[0] == 257

    hf, imported = hf_imported("qwen2", True)
    run_training([f"checkpoint.load={imported}", f"data.tokenizer={hf}", "trainer.max_steps=2",
                  "trainer.save_interval=2", "trainer.seq_length=32"], name="ft")
    export_hf(tmp_path / "ft" / "checkpoints", tmp_path / "ft_hf")
    assert {k: v.shape for k, v in tensors(tmp_path / "ft_hf").items()} == \
        {k: v.shape for k, v in tensors(hf).items()}
    assert (tmp_path / "ft_hf" / "tokenizer.json").read_bytes() == \
        (hf / "tokenizer.json").read_bytes()
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "ft_hf").config
    assert config.vocab_size == VOCAB
    assert config.max_position_embeddings == 64  # the imported model's, not the fine-tune's 32

    run_training([f"checkpoint.load={imported}", "+attention=head_gate", "trainer.max_steps=2",
                  "trainer.save_interval=2"], name="gated")
    export_hf(tmp_path / "gated" / "checkpoints", tmp_path / "gated_hf")
    gate = tensors(tmp_path / "gated_hf")["model.layers.0.self_attn.gate_proj.weight"]
    assert gate.shape == (4, 64)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gated_hf", trust_remote_code=True)
    assert torch.equal(model.model.layers[0].self_attn.gate_proj.weight, gate)

