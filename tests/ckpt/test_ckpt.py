"""`python -m ckpt` on a TP=1 checkpoint, in this process: inspect, verify, export/import, reshape's
checks; and the trainer's loading checks: damaged files, unsafe pickles, mismatched models."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from ckpt.__main__ import main
from ckpt.checksums import checksum_problems, has_manifest
from ckpt.load import CheckpointMismatchError, load_checkpoint
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint, CheckpointError, object_location
from ckpt.save import write_checkpoint
from ckpt.zarr_export import load_manifest
from parallel.distributed import init_process_group, shutdown
from tests.conftest import FAST, REPO, compose_config
from trainer.train import Trainer


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Callable[[list[str]], Trainer]]:
    """Builds a Trainer (model, optimizer, scheduler) for config overrides; closed afterwards."""
    built: list[Trainer] = []

    def build(overrides: list[str]) -> Trainer:
        built.append(Trainer(compose_config(FAST + overrides), tmp_path))
        return built[-1]

    yield build
    for t in built:
        t.close()


def ckpt_main(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out + out.err


def params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in t.model for p in chunk.parameters()]


def test_inspect_reports_step_settings_tp_and_every_tensor(root: Path, capsys) -> None:
    code, out = ckpt_main(["inspect", root, "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["step"] == 4 and d["tp"] == 1 and d["weights_dtype"] == "float32"
    assert d["model"]["num_layers"] == 2 and d["attention"]["kind"] == "standard"
    tensors = {t["key"]: t for t in d["tensors"]}
    assert tensors["embedding.word_embeddings.weight"]["shape"] == [384, 128]
    assert tensors["decoder.layers.self_attention.linear_proj.weight"]["tp_split"] == "axis 2"
    files = [p for p in (root / "iter_0000004").iterdir()]
    assert d["bytes_on_disk"] == sum(p.stat().st_size for p in files)
    assert d["objects"]["rng_state/tp1"] == 1
    code, out = ckpt_main(["inspect", root / "iter_0000002"], capsys)
    assert code == 0 and "step 2" in out and "saved at TP=1" in out and "linear_fc1.weight" in out


def test_verify_reads_everything_and_compares_checkpoints(root: Path, capsys) -> None:
    code, out = ckpt_main(["verify", root], capsys)
    assert code == 0 and "OK" in out and "24 tensors" in out
    assert ckpt_main(["verify", root, "--against", root / "iter_0000004"], capsys)[0] == 0
    code, out = ckpt_main(["verify", root, "--against", root / "iter_0000002"], capsys)
    assert code == 1 and "MISMATCH: max abs diff" in out and "tensors match" in out


def damage(ckpt: Path, kind: str) -> Path:
    """Damage one file of a checkpoint as a crash, a bad disk or a bad copy would; returns it."""
    distcp = ckpt / "__0_0.distcp"
    if kind == "truncated":
        os.truncate(distcp, distcp.stat().st_size // 2)
        return distcp
    if kind == "flipped":  # bytes in the middle of a tensor's data: torch's reader misses this
        with open(distcp, "r+b") as f:
            f.seek(distcp.stat().st_size // 2)
            data = f.read(8)
            f.seek(-8, os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))
        return distcp
    if kind == "missing":
        distcp.unlink()
        return distcp
    name = {"common": "common.pt", "index": ".metadata", "marker": "metadata.json"}[kind]
    (ckpt / name).write_bytes(b"\x80\x04garbage" * 3)
    return ckpt / name


@pytest.mark.parametrize("kind", ["truncated", "flipped", "missing", "common", "index", "marker"])
def test_a_damaged_checkpoint_fails_naming_the_file(root: Path, tmp_path: Path, kind: str,
                                                     trainer, capsys) -> None:
    ckpt = shutil.copytree(root / "iter_0000004", tmp_path / "iter_0000004")
    bad = damage(ckpt, kind)
    code, out = ckpt_main(["verify", ckpt], capsys)
    assert code != 0 and str(bad) in out
    t = trainer([])
    before = params(t)
    with pytest.raises(CheckpointError, match=str(bad)):
        load_checkpoint(ckpt, t.model, t.optimizer, t.scheduler)
    assert all(torch.equal(a, b) for a, b in zip(before, params(t)))


class Payload:
    """Unpickling this creates a directory: proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_checkpoint_pickles_never_run_code(root: Path, tmp_path: Path, trainer) -> None:
    marker = tmp_path / "code-ran"
    for name, save in (("common.pt", torch.save), (".metadata", pickle.dump)):
        ckpt = shutil.copytree(root / "iter_0000004", tmp_path / name / "iter_0000004")
        with open(ckpt / name, "wb") as f:
            save(Payload(marker), f)
        with pytest.raises(CheckpointError, match=f"(?si){name}.*(refusing|unsupported global)"):
            Checkpoint(ckpt)
    # An object item (where the RNG states live), which torch itself unpickles without limits.
    t = trainer([])
    source = Checkpoint(resolve_checkpoint(root))
    state = {**source.common, "sharded": {
        "weights": {k: ShardedTensor.from_rank_offsets(k, source.read(k), replica_id=0)
                    for k in source.tensors},
        "payload": ShardedObject("payload", Payload(marker), (1,), (0,), replica_id=0)}}
    ckpt = write_checkpoint(tmp_path / "object", 4, state)
    with pytest.raises(CheckpointError, match=r"(?si)__0_0\.distcp.*object.*unsupported global"):
        load_checkpoint(ckpt, t.model, t.optimizer, t.scheduler)
    assert not marker.exists()


@pytest.mark.parametrize("overrides, listed", [
    (["+attention=head_gate"], ["linear_qkv.weight._gate: not in the checkpoint",
                                "linear_qkv.weight: in the checkpoint"]),
    (["model.num_layers=3"], ["linear_proj.weight: checkpoint [2, 128, 128], model [3, 128, 128]"]),
    # Same shapes everywhere (8 heads of 16 = 4 heads of 32): only the saved config tells.
    (["model.num_attention_heads=8", "model.num_query_groups=4", "model.kv_channels=16"],
     ["num_attention_heads: checkpoint 4, this model 8"]),
])
def test_a_mismatched_model_fails_before_any_weight_is_touched(root: Path, trainer,
                                                                overrides, listed) -> None:
    t = trainer(overrides)
    before = params(t)
    with pytest.raises(CheckpointMismatchError, match="nothing was loaded") as error:
        load_checkpoint(resolve_checkpoint(root), t.model, t.optimizer, t.scheduler)
    for line in listed:
        assert line in str(error.value)
    assert all(torch.equal(a, b) for a, b in zip(before, params(t)))


def test_export_import_round_trip_is_bitwise(root: Path, tmp_path: Path, capsys) -> None:
    assert ckpt_main(["export", root, tmp_path / "zarr", "--format", "zarr"], capsys)[0] == 0
    manifest = load_manifest(tmp_path / "zarr")
    assert manifest["step"] == 4 and manifest["tp"] == 1
    assert manifest["meta"]["model"]["num_layers"] == 2
    qkv = manifest["tensors"]["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv["tp_axis"] == 1 and qkv["chunk_shape"] == [1, 256, 128] and qkv["dtype"] == "float32"
    assert ckpt_main(["import", tmp_path / "zarr", tmp_path / "back"], capsys)[0] == 0
    assert_same_checkpoint(resolve_checkpoint(root), resolve_checkpoint(tmp_path / "back"), capsys)
    assert_checksummed(resolve_checkpoint(tmp_path / "back"))


def assert_checksummed(ckpt: Path) -> None:
    """The checkpoint carries a checksum manifest and matches it."""
    assert has_manifest(ckpt) and checksum_problems(ckpt) == []


def assert_same_checkpoint(a: Path, b: Path, capsys) -> None:
    """Every tensor bitwise, the common state and every pickled object equal."""
    assert ckpt_main(["verify", a, "--against", b], capsys)[0] == 0
    x, y = Checkpoint(a), Checkpoint(b)
    assert repr(x.common) == repr(y.common)  # repr: tensors compare by value, tuples stay tuples
    assert sorted(x.objects) == sorted(y.objects)
    assert all(repr(x.read_object(k)) == repr(y.read_object(k)) for k in x.objects)


def bf16_copy(root: Path, dst: Path) -> Path:
    """The checkpoint as a GPU run saves it: bf16 weights, fp32 master weights in the optimizer
    (`optimizer.state.fp32_param.*`). CPU training cannot make one: megatron's bf16 optimizer
    needs CUDA."""
    source = Checkpoint(resolve_checkpoint(root))
    tensors = {k: source.read(k) for k in source.tensors}
    for key in [k for k in tensors if not k.startswith("optimizer.")]:
        tensors[f"optimizer.state.fp32_param.{key}"] = tensors[key]
        tensors[key] = tensors[key].to(torch.bfloat16)
    sharded: dict = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0)
                     for k, t in tensors.items()}
    for unique_key in source.objects:
        key, offset, shape = object_location(unique_key)
        [data] = source.read_object(unique_key)
        sharded[unique_key] = ShardedObject(key, data, shape, offset, replica_id=0)
    init_process_group(torch.device("cpu"))
    try:
        return write_checkpoint(dst, 4, {**source.common, "sharded": sharded})
    finally:
        shutdown()


def test_bf16_survives_export_and_import_bit_for_bit(root: Path, tmp_path: Path, capsys) -> None:
    bf16 = bf16_copy(root, tmp_path / "bf16")
    assert ckpt_main(["export", bf16, tmp_path / "zarr", "--format", "zarr"], capsys)[0] == 0
    array = tmp_path / "zarr" / "arrays" / "embedding.word_embeddings.weight" / "zarr.json"
    assert json.loads(array.read_text())["data_type"] == "bfloat16"
    assert ckpt_main(["import", tmp_path / "zarr", tmp_path / "back"], capsys)[0] == 0
    back = resolve_checkpoint(tmp_path / "back")
    assert Checkpoint(back).tensors["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert_same_checkpoint(bf16, back, capsys)


def test_reshape_dry_run_prints_the_plan_and_writes_nothing(root: Path, tmp_path: Path,
                                                            capsys) -> None:
    code, out = ckpt_main(["reshape", root, tmp_path / "dst", "--target-tp", "2", "--dry-run"],
                          capsys)
    assert code == 0 and not (tmp_path / "dst").exists() and list(tmp_path.iterdir()) == []
    row = next(line for line in out.splitlines() if line.startswith("embedding."))
    assert row.split() == ["embedding.word_embeddings.weight", "384x128", "axis", "0", "384x128",
                           "192x128"]
    fc1 = next(line for line in out.splitlines()
               if line.startswith("decoder.layers.mlp.linear_fc1.weight"))
    assert fc1.split()[-2:] == ["2x768x128", "2x384x128"] and "nothing written" in out


def test_reshape_refuses_a_non_empty_destination_and_impossible_sizes(root: Path, tmp_path: Path,
                                                                      capsys) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, out = ckpt_main(["reshape", root, dst, "--target-tp", "2"], capsys)
    assert code == 2 and "not empty; pass --overwrite" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"] and (dst / "keep.txt").exists()
    code, out = ckpt_main(["reshape", root, dst, "--target-tp", "3"], capsys)
    assert code == 2 and "num_attention_heads (4) is not divisible by 3" in out
    assert "num_query_groups (2) is not divisible by 3" in out
    code, out = ckpt_main(["reshape", root, root, "--target-tp", "2", "--overwrite"], capsys)
    assert code == 2 and "must not be, contain or lie inside the source" in out


def test_the_cli_explains_itself(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["reshape", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for flag in ("--target-tp", "--dry-run", "--overwrite", "--model-only", "--verify"):
        assert flag in out


@pytest.mark.slow  # a new interpreter
def test_the_command_line_refuses_in_one_line_with_exit_2(tmp_path: Path) -> None:
    """`python -m ckpt` as typed: a user error is one `error:` line and exit status 2."""
    proc = subprocess.run([sys.executable, "-m", "ckpt", "inspect", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "nope" in lines[0] and "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_a_bf16_checkpoint_reshapes_on_cpu_keeping_its_dtypes(root: Path, tmp_path: Path,
                                                              capsys) -> None:
    bf16 = bf16_copy(root, tmp_path / "bf16")
    code, out = ckpt_main(["reshape", bf16, tmp_path / "tp2", "--target-tp", "2", "--verify"],
                          capsys)
    assert code == 0 and "verified: 32 tensors (8 model) bitwise equal" in out, out
    assert_checksummed(resolve_checkpoint(tmp_path / "tp2"))
    tensors = Checkpoint(resolve_checkpoint(tmp_path / "tp2")).tensors
    assert tensors["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert tensors["optimizer.state.fp32_param.embedding.word_embeddings.weight"].dtype == \
        torch.float32


@pytest.mark.slow
def test_a_bf16_checkpoint_reshapes_to_the_distributed_optimizer_format(root: Path,
                                                                         tmp_path: Path,
                                                                         capsys) -> None:
    """Its fp32 master weights become the distributed optimizer's `param` (bit for bit), the
    step moves into the param groups."""
    bf16 = bf16_copy(root, tmp_path / "bf16")
    code, out = ckpt_main(["reshape", bf16, tmp_path / "dist", "--target-dist-opt", "on",
                           "--verify"], capsys)
    assert code == 0 and "verified: 32 tensors (8 model) bitwise equal" in out, out
    written = Checkpoint(resolve_checkpoint(tmp_path / "dist"))
    master = "optimizer.state.param.embedding.word_embeddings.weight"
    assert written.tensors[master].dtype == torch.float32
    assert not [k for k in written.tensors if k.startswith("optimizer.state.fp32_param.")]
    optimizer = written.common["optimizer"]
    assert optimizer["param_state_sharding_type"] == "fully_reshardable"
    assert {g["step"] for g in optimizer["optimizer"]["param_groups"]} == {4.0}
    assert written.meta.layout.distributed_optimizer is True
