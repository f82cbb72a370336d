"""`python -m ckpt` across TP sizes with real multi-process runs: a TP=2 checkpoint (plain and
head-gated) reshaped to TP=1 (and TP=4) resumes there with the same next-step loss; its zarr
export serves each TP rank's slice from that rank's chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.__main__ import main
from ckpt.layout import tp_layout
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from ckpt.zarr_export import load_manifest, read_rank_shard
from tests.conftest import FAST, read_metrics, train_on_ranks

pytestmark = pytest.mark.slow

HEADS = ["model.num_attention_heads=4", "model.num_query_groups=4"]  # fits TP=1, 2 and 4
STEPS = ["trainer.max_steps=4", "trainer.save_interval=3"]  # checkpoint at 3, one step after


# (attention, TP sizes to reshape to and resume at). The gated model runs every code path the
# plain one does (SwiGLU, GQA, the optimizer state mirrored after its parameter) plus the
# [QKV; Gate] factory; the plain one skips TP=4 (a 4-process reshape and resume: ~30 s).
VARIANTS = [("standard", (1,)), ("head_gate", (1, 4))]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def tp2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[list[str], Path, tuple[int, ...]]:
    """(overrides, directory, target TP sizes) of a 4-step TP=2 run, in `directory/tp2`."""
    attention, targets = request.param
    overrides = FAST + HEADS + (["+attention=head_gate"] if attention == "head_gate" else [])
    cwd = tmp_path_factory.mktemp(attention)
    train_on_ranks(overrides + STEPS + ["parallel.tp=2"], cwd / "tp2", nproc=2)
    return overrides, cwd, targets


def test_reshaped_checkpoint_resumes_at_another_tp_with_the_same_next_step_loss(tp2) -> None:
    overrides, cwd, targets = tp2
    src = cwd / "tp2" / "checkpoints" / "iter_0000003"
    # The TP=2 run's own step 4 is what resuming it at TP=2 gives: on CPU a resume reproduces
    # the uninterrupted run exactly (tests/trainer/test_cli.py).
    expected = read_metrics(cwd / "tp2")[3]["loss"]
    for tp in targets:
        dst = cwd / f"reshaped_tp{tp}"
        assert main(["reshape", str(src), str(dst), "--target-tp", str(tp), "--verify"]) == 0
        ckpt = Checkpoint(resolve_checkpoint(dst))
        assert ckpt.meta.layout.tp == tp and ckpt.meta.step == 3
        assert ckpt.meta.reshaped_from.tp == 2
        assert not [k for k in ckpt.objects if k.startswith("rng_state")]
        # megatron's own TP=tp sharding (the chunks its ranks wrote) is what the plan predicts.
        for info in ckpt.tensors.values():
            layout = tp_layout(info.key, swiglu=True)
            if layout.axis is not None:
                pieces = {c.size[layout.axis] for c in info.chunks}
                assert pieces == {layout.piece(info.shape[layout.axis], tp)}, info.key
        resume = overrides + STEPS + [f"checkpoint.load={dst}", "checkpoint.save=false"]
        rows = train_on_ranks(resume + [f"parallel.tp={tp}"], cwd / f"at_tp{tp}", nproc=tp)
        assert [r["step"] for r in rows] == [4]
        assert rows[0]["loss"] == pytest.approx(expected, rel=1e-4), tp


def stored_shard(ckpt: Checkpoint, key: str, rank: int) -> torch.Tensor | None:
    """What TP rank `rank` held of `key`: the global tensor at the ranges of the chunks that rank
    wrote (rank r writes `__r_0.distcp`); None for tensors every rank holds whole."""
    axis = tp_layout(key, swiglu=True).axis
    mine = [c for c in ckpt.tensors[key].chunks if c.item.file == f"__{rank}_0.distcp"]
    if axis is None:
        return None
    ranges = sorted({(c.offset[axis], c.offset[axis] + c.size[axis]) for c in mine})
    full = ckpt.read(key)
    return torch.cat([full.narrow(axis, a, b - a) for a, b in ranges], dim=axis)


def test_zarr_export_serves_each_rank_slice_from_its_own_chunks(tp2) -> None:
    overrides, cwd, _ = tp2
    src = cwd / "tp2" / "checkpoints" / "iter_0000003"
    export = cwd / "zarr"
    assert main(["export", str(src), str(export), "--format", "zarr"]) == 0
    ckpt = Checkpoint(src)
    sharded = [k for k in ckpt.tensors if tp_layout(k, swiglu=True).axis is not None]
    for key in sharded:
        for rank in (0, 1):
            assert torch.equal(read_rank_shard(export, key, 2, rank),
                               stored_shard(ckpt, key, rank)), (key, rank)
    manifest = load_manifest(export)
    if "+attention=head_gate" in overrides:
        fused = manifest["fused"]["decoder.layers.self_attention.linear_qkv.weight"]
        assert fused["sizes"] == [384, 4] and fused["axis"] == 1

    # Rank 0 reads only its own chunks: with every chunk of rank 1 destroyed, rank 0's slice
    # still reads back and rank 1's does not.
    key = "decoder.layers.mlp.linear_fc1.weight"  # SwiGLU: two pieces per rank
    entry = manifest["tensors"][key]
    piece = entry["chunk_shape"][1]
    theirs = {a // piece for a, _ in tp_layout(key, swiglu=True).ranges(entry["shape"][1], 2, 1)}
    destroyed = 0
    chunks = export / entry["path"] / "c"  # zarr v3 chunk keys: c/<layer>/<row piece>/<col>
    for chunk in chunks.rglob("*"):
        if chunk.is_file() and int(chunk.relative_to(chunks).parts[1]) in theirs:
            chunk.write_bytes(b"not a chunk")
            destroyed += 1
    assert destroyed == 2 * 2  # 2 layers x 2 pieces
    assert torch.equal(read_rank_shard(export, key, 2, 0), stored_shard(ckpt, key, 0))
    with pytest.raises(ValueError):
        read_rank_shard(export, key, 2, 1)
