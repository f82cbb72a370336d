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
from tests.ckpt.hf_models import VOCAB, hf_logits, save_hf

TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def test_export_import_export_is_bitwise(tmp_path: Path) -> None:
    hf = save_hf(tmp_path / "hf", "llama", tied=False)
    import_hf(hf, tmp_path / "ckpt", 2)
    # From TP=2, sharded (an index) by a small shard limit: the next import reads an index.
    export_hf(tmp_path / "ckpt", tmp_path / "out1", max_shard_bytes=100_000)
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
