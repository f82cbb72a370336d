"""A hostile Hugging Face directory given to `python -m ckpt import-hf`.

Absurd sizes are refused against the tensors present (no hang, no memory blow-up), index entries
are confined to HF_DIR before any file is opened, and malformed configs, indexes and safetensors
files end as one `error:` line naming the file and key, never a traceback. The next attacker of
this surface starts here.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import ckpt.hf_import
from ckpt.__main__ import main
from tests.ckpt.cli import refused
from tests.ckpt.hf_models import save_hf
from tests.module_runs import run_module

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 saved in 50 KB shards (an index), made once; tests work on copies."""
    return save_hf(tmp_path_factory.mktemp("hf") / "hf", "qwen2", tied=False,
                   max_shard_size="50KB")


@pytest.fixture
def hf(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "case" / "hf"))


def _edit(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _refused(capsys: pytest.CaptureFixture, hf: Path, *words: str) -> str:
    """import-hf --dry-run exits 2 with one `error:` line holding `words`."""
    return refused(capsys, ["import-hf", str(hf), str(hf.parent / "dst"), "--dry-run"], *words)


def test_the_pristine_copy_imports(hf: Path, capsys: pytest.CaptureFixture) -> None:
    """The attacks below differ from this one by the damage alone."""
    assert main(["import-hf", str(hf), str(hf.parent / "dst"), "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
@pytest.mark.parametrize(("layers", "why"), [(1_000_000_000, "must be a whole number in [1, 1024]"),
                                             (1000, "layers 0..1")])
def test_a_billion_layers_is_refused_fast_against_the_tensors_present(hf: Path, layers: int,
                                                                     why: str) -> None:
    """Listing 9 x 10^9 expected tensors hung at 2.9 GB; the bound on every model's layers
    (models/validation.py) refuses it, and the layer count present decides below it."""
    _edit(hf / "config.json", num_hidden_layers=layers)
    start = time.monotonic()
    proc = run_module("ckpt", ["import-hf", str(hf), str(hf.parent / "dst"), "--dry-run"],
                      hf.parent, timeout=120)
    if proc.returncode == -9:
        pytest.fail("import-hf --dry-run still running after 120 s")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and f"num_hidden_layers={layers}" in proc.stderr
    assert why in proc.stderr, proc.stderr
    assert time.monotonic() - start < 120


def test_one_layer_more_than_present_names_the_setting(hf: Path, capsys) -> None:
    _edit(hf / "config.json", num_hidden_layers=3)
    _refused(capsys, hf, "num_hidden_layers=3", "2 layers")


def _outside_copy(hf: Path) -> tuple[Path, str]:
    """A valid shard copied outside HF_DIR (so an import that followed the entry would work),
    and the index entry it replaces."""
    index = json.loads((hf / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = hf.parent.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copyfile(hf / shard, outside / "b.safetensors")
    return outside / "b.safetensors", shard


def _point(hf: Path, shard: str, entry: str) -> None:
    index = json.loads((hf / INDEX).read_text())
    index["weight_map"] = {k: entry if v == shard else v for k, v in index["weight_map"].items()}
    (hf / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("attack", ["dotdot", "absolute", "symlink", "passwd"])
def test_weight_map_entries_are_confined_to_hf_dir_before_anything_is_opened(
        hf: Path, capsys, monkeypatch: pytest.MonkeyPatch, attack: str) -> None:
    outside, shard = _outside_copy(hf)
    if attack == "dotdot":
        entry = "../../outside/b.safetensors"
        _point(hf, shard, entry)
    elif attack == "absolute":
        entry = str(outside)
        _point(hf, shard, entry)
    elif attack == "symlink":
        entry = shard
        (hf / shard).unlink()
        (hf / shard).symlink_to(outside)
    else:
        entry = "/etc/passwd"
        _point(hf, shard, entry)
    opened: list[str] = []
    real_open = ckpt.hf_import.safe_open
    monkeypatch.setattr(ckpt.hf_import, "safe_open",
                        lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    _refused(capsys, hf, INDEX, entry, "outside")
    assert opened == []


def test_a_hub_cache_snapshot_linking_into_its_blobs_still_imports(hf: Path, capsys) -> None:
    """huggingface_hub's cache links snapshots/<rev>/<file> to ../../blobs/<hash>: that is the
    model's own directory, not outside it."""
    repo = hf.parent / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(hf.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    assert main(["import-hf", str(snapshot), str(hf.parent / "dst"), "--dry-run"]) == 0


def _write_raw(path: Path, text: str) -> None:
    path.write_text(text)


@pytest.mark.parametrize(("damage", "words"), [
    (lambda hf: _write_raw(hf / "config.json", "[1, 2]"), ("config.json", "JSON object")),
    (lambda hf: _edit(hf / "config.json", vocab_size="300"), ("vocab_size='300'",)),
    (lambda hf: _edit(hf / "config.json", rope_parameters={"rope_theta": "abc"}),
     ("rope_theta='abc'",)),
    # json.dumps writes float("inf") as `Infinity`, which JSON readers in Python accept
    (lambda hf: _edit(hf / "config.json", rope_parameters={"rope_theta": float("inf")}),
     ("rope_theta=inf",)),
    (lambda hf: _edit(hf / "config.json", rope_parameters=None, rope_theta=-5.0),
     ("rope_theta=-5.0",)),
    (lambda hf: _edit(hf / "config.json", max_position_embeddings=-1),
     ("max_position_embeddings=-1",)),
    (lambda hf: _edit(hf / "config.json", rms_norm_eps=float("nan")), ("rms_norm_eps=nan",)),
    (lambda hf: _edit(hf / "config.json", rms_norm_eps=-1e-6), ("rms_norm_eps=-1e-06",)),
    (lambda hf: _edit(hf / "config.json", num_attention_heads=True),
     ("num_attention_heads=True",)),
    (lambda hf: _edit(hf / "config.json", rope_scaling=[1]), ("rope_scaling",)),
    (lambda hf: _edit(hf / INDEX, weight_map=["model-00001-of-00002.safetensors"]),
     (INDEX, "weight_map")),
    (lambda hf: _write_raw(hf / INDEX, "[]"), (INDEX, "JSON object")),
    (lambda hf: _write_raw(hf / INDEX, "{not json"), (INDEX, "not valid JSON")),
    (lambda hf: _edit(hf / INDEX, weight_map={"model.norm.weight": 7}), (INDEX, "7")),
])
def test_malformed_configs_and_indexes_are_one_error_line(hf: Path, capsys, damage,
                                                          words: tuple[str, ...]) -> None:
    damage(hf)
    _refused(capsys, hf, *words)


def _first_shard(hf: Path) -> Path:
    return sorted(hf.glob("model-*.safetensors"))[0]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _giant_header(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 2**40) + b"{" * 64)


def _header_not_json(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 12) + b"not json!!!!")


@pytest.mark.parametrize("damage", [_truncate, lambda p: p.write_bytes(b""), _giant_header,
                                    _header_not_json])
def test_broken_safetensors_files_are_named(hf: Path, capsys, damage) -> None:
    shard = _first_shard(hf)
    damage(shard)
    _refused(capsys, hf, shard.name, "safetensors")


def test_a_broken_single_model_file_is_named(tmp_path: Path, capsys) -> None:
    hf = save_hf(tmp_path / "one", "llama", tied=True)
    _truncate(hf / "model.safetensors")
    _refused(capsys, hf, "model.safetensors")


# A "longctx" block as an export writes it (ckpt/hf_export.py), for the attacks below to damage.
_DCA = {"attention": "dca", "head_wise_attn_gate": False, "qkv_bias": True,
        "dca_chunk_size": 48, "dca_local_size": 6, "original_max_position_embeddings": 64}


def _longctx(**changes: object) -> Callable[[Path], None]:
    return lambda hf: _edit(hf / "config.json", longctx={**_DCA, **changes})


def test_a_longctx_block_as_exported_imports(hf: Path, capsys) -> None:
    _longctx()(hf)
    assert main(["import-hf", str(hf), str(hf.parent / "dst"), "--dry-run"]) == 0
    assert "attention dca" in capsys.readouterr().out


@pytest.mark.parametrize(("damage", "words"), [
    # "false" is true in Python: the model imported as tied, its trained lm_head dropped
    (lambda hf: _edit(hf / "config.json", tie_word_embeddings="false"),
     ("tie_word_embeddings='false' must be true or false",)),
    (lambda hf: _edit(hf / "config.json", attention_bias="no"), ("attention_bias='no'",)),
    (lambda hf: _edit(hf / "config.json", use_sliding_window=0), ("use_sliding_window=0",)),
    (lambda hf: _edit(hf / "config.json", hidden_act=5), ("hidden_act=5 must be a string",)),
    (lambda hf: _edit(hf / "config.json", num_key_value_heads=3),
     ("num_attention_heads (4) must be divisible by num_key_value_heads (3)",)),
    (lambda hf: _edit(hf / "config.json", head_dim=15), ("head dimension (15) must be even",)),
    (lambda hf: _edit(hf / "config.json", num_hidden_layers=10**9),
     ("num_hidden_layers=1000000000 must be a whole number in [1, 1024]",)),
    (lambda hf: _edit(hf / "config.json", vocab_size=10**9), ("vocab_size=1000000000",)),
    # a hostile "longctx" block: 32-line `[rank0]` tracebacks before
    (_longctx(dca_chunk_size=-5), ('"longctx".dca_chunk_size=-5 must be a whole number',)),
    (_longctx(dca_chunk_size="abc"), ('"longctx".dca_chunk_size=\'abc\'',)),
    (_longctx(dca_local_size=0), ('"longctx".dca_local_size=0',)),
    (_longctx(dca_local_size=100), ('"longctx".dca_chunk_size (48) must exceed '
                                    '"longctx".dca_local_size (100)',)),
    (_longctx(attention="evil"), ('"longctx".attention=\'evil\' must be one of',)),
    (_longctx(attention="chunked", chunk_size=[8]), ('"longctx".chunk_size=[8]',)),
    (_longctx(head_wise_attn_gate="true"), ('"longctx".head_wise_attn_gate=\'true\'',)),
    (_longctx(qkv_bias="yes"), ('"longctx".qkv_bias=\'yes\'',)),
    (_longctx(dca_chunk_sise=64), ("dca_chunk_sise",)),
    (lambda hf: _edit(hf / "config.json", longctx=[_DCA]), ("longctx=[", "object of settings")),
])
def test_wrongly_typed_settings_are_one_error_line(hf: Path, capsys, damage,
                                                   words: tuple[str, ...]) -> None:
    damage(hf)
    _refused(capsys, hf, "config.json", *words)


@pytest.mark.parametrize("carrier", ["auto_map", "file"])
def test_remote_code_without_its_longctx_block_is_refused(hf: Path, capsys, carrier: str) -> None:
    """An export of a DCA model whose config.json lost its block imported as standard
    attention without a word."""
    if carrier == "auto_map":
        _edit(hf / "config.json", auto_map={
            "AutoConfig": "configuration_longctx.LongCtxQwen2Config",
            "AutoModelForCausalLM": "modeling_longctx.LongCtxQwen2ForCausalLM"})
    else:
        (hf / "modeling_longctx.py").write_text("# the export's remote code\n")
    _refused(capsys, hf, "config.json", 'no "longctx" block')


def test_nan_weights_import_with_one_warning_naming_the_tensor(tmp_path: Path, capfd) -> None:
    """They imported without a word; now one warning line per tensor (the import completes, as
    transformers loads such a file too: docs/failures.md)."""
    from safetensors.torch import load_file, save_file

    hf = save_hf(tmp_path / "hf", "llama", tied=True)
    weights = load_file(hf / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    weights["model.layers.1.mlp.up_proj.weight"][0, :2] = float("inf")
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    assert main(["import-hf", str(hf), str(tmp_path / "dst")]) == 0
    warnings = [line for line in capfd.readouterr().err.splitlines()
                if line.startswith("warning: ")]
    assert len(warnings) == 2, warnings
    assert "tensor model.norm.weight holds 1 NaN or infinite values" in warnings[0] \
        or "tensor model.norm.weight holds 1 NaN or infinite values" in warnings[1], warnings
    assert any("model.layers.1.mlp.up_proj.weight holds 2" in w for w in warnings), warnings
