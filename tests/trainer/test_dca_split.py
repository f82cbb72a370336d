"""DCA applied to a model that exists: unset sizes take the trained ones (a DCA-trained
checkpoint) or ChunkLlama's split of the model's length (3T/4, T/16), in trainer.eval and in a
fine-tune; eval.json records the values used; bench/compare_eval.py reads RULER results."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from models.schema import dca_pretrained_split
from tests.ckpt.longctx_models import write_variant
from tests.conftest import compose_config
from trainer.defaults import adopt_dca_split, set_sizes
from trainer.evals import ruler_run
from trainer.evals.results import EvalResults, PasskeyCell, PerplexityPoint
from trainer.evals.ruler.scoring import SuiteResult


def test_the_pretrained_split_is_chunkllamas() -> None:
    assert dca_pretrained_split(8192) == (6144, 512)
    assert dca_pretrained_split(4096) == (3072, 256)
    assert dca_pretrained_split(2) == (2, 1)  # never a chunk under 2 or a window under 1


@pytest.mark.parametrize(("typed", "trained", "expected"), [
    ({}, ("standard", (0, 0)), (768, 64)),                  # the split of T = 1024
    ({}, ("dca", (256, 32)), (256, 32)),                   # as trained
    ({"dca_chunk_size": 512}, ("standard", (0, 0)), (512, 64)),
    ({"dca_chunk_size": 48}, ("standard", (0, 0)), (48, 4)),  # the split's 64 >= 48: 48 // 12
    ({"dca_local_size": 8}, ("standard", (0, 0)), (768, 8)),
])
def test_unset_sizes_are_filled(typed: dict, trained: tuple, expected: tuple) -> None:
    attention = OmegaConf.create({"kind": "dca", "dca_chunk_size": 999, "dca_local_size": 99}
                                 | typed)
    note = adopt_dca_split(attention, trained[0], trained[1], 1024, set(typed))
    assert (attention.dca_chunk_size, attention.dca_local_size) == expected and note


@pytest.mark.parametrize(("scaling", "typed", "trained", "floor"), [
    ("log", {}, "standard", 1024),                        # from the model's length T on
    ("log", {"dca_scaling_floor_scale": 300}, "standard", 300),
    ("log", {}, "dca", 8192),                             # a DCA-trained model: as set
    ("yarn", {}, "standard", 8192),                       # log's setting only
])
def test_the_log_scaling_starts_at_a_pretrained_models_length(scaling: str, typed: dict,
                                                              trained: str, floor: int) -> None:
    attention = OmegaConf.create({"kind": "dca", "dca_chunk_size": 100, "dca_local_size": 10,
                                  "dca_scaling": scaling, "dca_scaling_floor_scale": 8192}
                                 | typed)
    typed = set(typed) | {"dca_chunk_size", "dca_local_size"}
    note = adopt_dca_split(attention, trained, (100, 10), 1024, typed)
    assert attention.dca_scaling_floor_scale == floor
    assert (note is not None and "log scaling from the model's length 1024" in note) \
        == (floor == 1024)


def test_typed_sizes_and_other_kinds_are_left_alone() -> None:
    both = OmegaConf.create({"kind": "dca", "dca_chunk_size": 100, "dca_local_size": 10})
    assert adopt_dca_split(both, "standard", (0, 0), 1024, set_sizes(both)) is None
    assert (both.dca_chunk_size, both.dca_local_size) == (100, 10)
    chunked = OmegaConf.create({"kind": "chunked", "dca_chunk_size": 100, "dca_local_size": 10})
    assert adopt_dca_split(chunked, "standard", (0, 0), 1024, set()) is None


def test_the_yaml_defaults_count_as_unset() -> None:
    cfg = compose_config(["+attention=dca"])
    assert set_sizes(cfg.attention) == set()
    cfg = compose_config(["+attention=dca", "attention.dca_chunk_size=64",
                          "attention.dca_scaling_floor_scale=512"])
    assert set_sizes(cfg.attention) == {"dca_chunk_size", "dca_scaling_floor_scale"}


class _NoSweep:
    mode = None


def oracle(model, tokenizer, samples, options, progress=True, phases=None):
    return [""] * len(samples)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split")
    return {"standard": write_variant(root / "standard", "gated-qwen2", seq_length=1024,
                                      head_wise_attn_gate=False),
            "dca": write_variant(root / "dca", "dca-qwen2", seq_length=1024)}


@pytest.mark.parametrize(("name", "extra", "expected"), [
    ("standard", ["+attention=dca"], ("dca", 768, 64)),     # the split of its length
    ("dca", [], ("dca", 16, 4)),                           # its own attention, as trained
    ("dca", ["+attention=dca"], ("dca", 16, 4)),           # DCA chosen, sizes as trained
    ("standard", [], ("standard", None, None)),
    ("standard", ["+attention=dca", "attention.dca_chunk_size=512",
                  "attention.dca_local_size=16"], ("dca", 512, 16)),
    ("standard", ["+attention=dca", "attention.dca_scaling=log"], ("dca", 768, 64)),
])
def test_eval_runs_the_attention_the_model_implies(checkpoints, tmp_path: Path, monkeypatch,
                                                   name: str, extra: list[str],
                                                   expected: tuple) -> None:
    from trainer import eval as eval_entry

    monkeypatch.setattr(eval_entry.HydraConfig, "get", staticmethod(lambda: _NoSweep()))
    monkeypatch.setattr(ruler_run, "decode", oracle)
    cfg = compose_config(extra + [f"checkpoint.load={checkpoints[name]}", "eval.suite=ruler",
                                  "eval.tasks=[niah_single_1]", "eval.lengths=[1024]",
                                  "eval.samples=1", "logger=none", "trainer.device=cpu"])
    results = eval_entry.evaluate(cfg, tmp_path)
    attention = results["attention"]
    kind, chunk, local = expected
    assert attention["kind"] == kind
    if chunk is not None:
        assert (attention["dca_chunk_size"], attention["dca_local_size"]) == (chunk, local)
    if attention.get("dca_scaling") == "log":  # from the model's length on
        assert attention["dca_scaling_floor_scale"] == 1024
    assert "${" not in json.dumps(attention)  # resolved values, not interpolations


@pytest.mark.slow
def test_a_fine_tune_of_a_model_trained_without_dca_takes_the_split(checkpoints,
                                                                  tmp_path: Path) -> None:
    from tests.conftest import FAST, train_on_ranks

    train_on_ranks(FAST + [f"checkpoint.load={checkpoints['standard']}", "+attention=dca",
                           "trainer.max_steps=1", "trainer.warmup_steps=0",
                           "trainer.seq_length=128"], tmp_path / "ft")
    saved = (tmp_path / "ft" / "checkpoints" / "iter_0000001").is_dir()
    assert saved
    from ckpt.reader import Checkpoint

    meta = Checkpoint(tmp_path / "ft" / "checkpoints" / "iter_0000001").meta
    assert (meta.attention.dca_chunk_size, meta.attention.dca_local_size) == (768, 64)


def _results(label: str, **measured) -> EvalResults:
    return EvalResults(checkpoint="ckpt", step=1, trained_attention="standard",
                       attention={"kind": label}, label=label, rope={}, trained_length=1024,
                       **measured)


def test_compare_eval_tabulates_ruler_and_passkey_runs(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both suites in one call (as the README's `outputs/*/*/eval.json` gives them): a table
    each, repeated labels told apart by their directory, one plot."""
    files = []
    for name, result in (
            ("dca", _results("dca", suite="ruler", ruler=SuiteResult(
                [], {1024: 50.0, 2048: 40.0}, None, 85.6))),
            ("standard", _results("standard", suite="ruler", ruler=SuiteResult(
                [], {1024: 45.0}, None, 85.6))),
            ("a", _results("standard", passkey=[PasskeyCell(1024, 0.5, 3, 4)],
                           perplexity=[PerplexityPoint(1024, 0.0, 1)])),
            ("b", _results("standard", passkey=[PasskeyCell(2048, 0.5, 1, 4)]))):
        files.append(result.write((tmp_path / name).mkdir() or tmp_path / name))
    script = Path(__file__).resolve().parents[2] / "bench" / "compare_eval.py"
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, files), "--out",
                                      str(tmp_path / "c.png")])
    runpy.run_path(str(script), run_name="__main__")  # as `python bench/compare_eval.py ...`
    out = capsys.readouterr().out
    assert "| dca | 50.0 | 40.0 | - |" in out
    assert "| standard | 45.0 |  | - |" in out
    assert f"| standard ({tmp_path / 'a'}) | 0.75 / 1.00 |  |" in out
    assert f"| standard ({tmp_path / 'b'}) |  | 0.25 / - |" in out
    assert (tmp_path / "c.png").stat().st_size > 0


def test_compare_eval_refuses_a_missing_file_in_one_line(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    script = Path(__file__).resolve().parents[2] / "bench" / "compare_eval.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "none.json")])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith("error: no eval.json at ") and err.count("\n") == 1
