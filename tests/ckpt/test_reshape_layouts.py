"""Checkpoints across the optimizer format and pipeline layouts: a run saved with
`parallel.distributed_optimizer` off resumes with it on and the reverse, and `ckpt reshape`
rewrites a checkpoint for TP2 x PP2 with the distributed optimizer and back to TP1 x PP2
without it, each resuming with the losses and grad norms of the run that never switched (Adam
moments, master weights and step carried over); the dry run's shards are the ones megatron
writes; a layout the model cannot take is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ckpt.__main__ import main
from ckpt.inspect import describe
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from ckpt.reshape_plan import plan
from parallel.placement import Layout
from tests.conftest import FAST, compose_config, read_metrics, train_on_ranks
from trainer.train import train

# 2 layers (PP 2), 4 heads and 2 query groups (TP 2); a checkpoint after step 1 of 3, so a
# resume runs two steps: the second one's loss depends on the optimizer state carried over.
# On the CPU on every machine, as the multi-process runs it is compared with (train_on_ranks).
RUN = FAST + ["trainer.max_steps=3", "trainer.log_interval=1", "trainer.device=cpu"]


def _train(cwd: Path, name: str, overrides: list[str]) -> list[dict]:
    (cwd / name).mkdir()
    train(compose_config(RUN + [f"checkpoint.dir={cwd / name / 'checkpoints'}"] + overrides),
          cwd / name)
    return read_metrics(cwd / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    """Two single-process runs, the distributed optimizer off (`plain`) and on (`dist`), each
    saved after step 1: (their directory, their metrics)."""
    cwd = tmp_path_factory.mktemp("formats")
    metrics = {name: _train(cwd, name, ["trainer.save_interval=1",
                                        f"parallel.distributed_optimizer={flag}"])
               for name, flag in (("plain", "false"), ("dist", "true"))}
    return cwd, metrics


def _assert_continues(resumed: list[dict], expected: list[dict], rel: float = 1e-6) -> None:
    """`resumed` ran steps 2 and 3 with `expected`'s losses and grad norms."""
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == [2, 3]
    for a, b in zip(resumed, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel, abs=rel)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=10 * rel)


@pytest.mark.parametrize(("source", "flag"), [("plain", "true"), ("dist", "false")])
@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_a_resume_switches_the_optimizer_format(saved, source: str, flag: str) -> None:
    cwd, metrics = saved
    ckpt = cwd / source / "checkpoints" / "iter_0000001"
    resumed = _train(cwd, f"{source}_to_{flag}", [f"checkpoint.load={ckpt}",
                                                  "checkpoint.save=false",
                                                  f"parallel.distributed_optimizer={flag}"])
    _assert_continues(resumed, metrics[source][1:])


def _assert_plan_is_what_megatron_wrote(src: Path, dst: Path, target: Layout) -> None:
    """Every chunk DST's ranks wrote is one piece of a shard the dry-run plan of SRC -> target
    listed, written by one of the ranks it names, and the chunks cover every tensor once."""
    written = Checkpoint(resolve_checkpoint(dst))
    rows = {r.target_key: r for r in plan(Checkpoint(resolve_checkpoint(src)), target, False)}
    assert set(rows) == set(written.tensors)
    for key, info in written.tensors.items():
        volume = 0
        for chunk in info.chunks:
            rank = int(chunk.item.file.split("_")[2])
            box = [(o, o + s) for o, s in zip(chunk.offset, chunk.size, strict=True)]
            assert any(rank in shard.ranks and all(
                any(a <= lo and hi <= b for a, b in axis) for (lo, hi), axis in
                zip(box, shard.ranges, strict=True)) for shard in rows[key].after), (key, box)
            volume += math.prod(chunk.size)
        assert volume == math.prod(info.shape), key


@pytest.mark.slow
def test_reshape_to_tp2_pp2_dist_opt_and_back_to_tp1_pp2_resumes(saved, capsys) -> None:
    cwd, metrics = saved
    src = cwd / "plain" / "checkpoints" / "iter_0000001"
    tp2pp2, tp1pp2 = cwd / "tp2pp2_dist", cwd / "tp1pp2_plain"
    assert main(["reshape", str(src), str(tp2pp2), "--target-tp", "2", "--target-pp", "2",
                 "--target-dist-opt", "on", "--verify"]) == 0
    _assert_plan_is_what_megatron_wrote(src, tp2pp2, Layout(tp=2, pp=2, distributed_optimizer=True))
    assert main(["reshape", str(tp2pp2), str(tp1pp2), "--target-tp", "1",
                 "--target-dist-opt", "off", "--verify"]) == 0
    layout = describe(Checkpoint(resolve_checkpoint(tp1pp2)))["layout"]
    assert (layout["tp"], layout["pp"], layout["distributed_optimizer"]) == (1, 2, False)
    assert "verified" in capsys.readouterr().out

    # The unreshaped TP2 x PP2 checkpoint resumed directly, in one process without the
    # distributed optimizer, and the reshaped one at TP1 x PP2: both continue the saving run.
    direct = _train(cwd, "direct", [f"checkpoint.load={tp2pp2}", "checkpoint.save=false"])
    _assert_continues(direct, metrics["plain"][1:])
    reshaped = train_on_ranks(RUN + [f"checkpoint.load={tp1pp2}", "checkpoint.save=false",
                                     "parallel.pp=2"], cwd / "reshaped", nproc=2)
    _assert_continues(reshaped, direct, rel=1e-5)
    _assert_continues(reshaped, metrics["plain"][1:], rel=1e-5)


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_dry_run_lists_every_shard_before_and_after_and_writes_nothing(saved, capsys) -> None:
    cwd, _ = saved
    src, dst = cwd / "dist" / "checkpoints", cwd / "dry"
    code = main(["reshape", str(src), str(dst), "--target-pp", "2", "--target-dist-opt", "off",
                 "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and not dst.exists() and "nothing written" in out
    assert "before (TP=1 PP=1 distributed_optimizer=true) and after (TP=1 PP=2 " \
           "distributed_optimizer=false)" in out
    lines = out.splitlines()
    # A stacked tensor: both layers on rank 0 before, one per pipeline stage after.
    at = lines.index("decoder.layers.mlp.linear_fc2.weight  2x128x384")
    assert lines[at + 1].split() == ["before", "2x128x384", "[0:2,", "0:128,", "0:384]", "on",
                                     "rank", "0"]
    assert lines[at + 2].split()[:3] == ["after", "1x128x384", "[0:1,"]
    assert lines[at + 3].split()[:2] == ["1x128x384", "[1:2,"] and lines[at + 3].endswith("1")
    # fp32 master weights: the plain fp32 optimizer keeps none (they are the model weights).
    master = "optimizer.state.param.embedding.word_embeddings.weight"
    assert lines[lines.index(f"{master}  384x128") + 2].split() == ["after", "(not", "written)"]


def test_a_layout_the_model_cannot_take_is_refused(root: Path, tmp_path: Path, capsys) -> None:
    # The same model as `saved`'s runs, in the checkpoint tests' shared run (tests/ckpt/conftest.py)
    dst = tmp_path / "refused"
    code = main(["reshape", str(root), str(dst), "--target-pp", "3", "--target-tp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and not dst.exists() and err.startswith("error: cannot reshape")
    assert len(err.strip().splitlines()) == 1, err
    assert "model.num_layers (2) is not divisible by --target-pp (3)" in err
    assert "model.num_attention_heads (4) is not divisible by 3" in err
    code = main(["reshape", str(root), str(dst)])
    assert code == 2 and "nothing to do" in capsys.readouterr().err
