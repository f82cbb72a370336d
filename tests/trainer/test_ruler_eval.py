"""`trainer.eval eval.suite=ruler` end to end on a tiny checkpoint, the suite's wiring (scores,
averages and effective length through the pipeline), and bad input refused before any model
loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ckpt.longctx_models import write_variant
from tests.conftest import compose_config
from tests.module_runs import run_module
from trainer.errors import UserError
from trainer.evals import ruler_run
from trainer.validate import validate_eval

TASKS = "[niah_single_1,niah_multikey_2,vt,fwe]"
LENGTH = 1024  # bytes: the byte tokenizer's prompts of these tasks fit


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_variant(tmp_path_factory.mktemp("ruler") / "ckpt", "dca-qwen2",
                         seq_length=LENGTH // 2)


def config(checkpoint: Path, *extra: str):
    return compose_config([f"checkpoint.load={checkpoint}", "eval.suite=ruler",
                           f"eval.tasks={TASKS}", f"eval.lengths=[{LENGTH}]", "eval.samples=2",
                           "eval.batch_size=2", "trainer.device=cpu", "logger.mode=offline",
                           *extra])


class _NoSweep:
    mode = None


def run(cfg, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    from trainer import eval as eval_entry

    monkeypatch.setattr(eval_entry.HydraConfig, "get", staticmethod(lambda: _NoSweep()))
    out.mkdir(exist_ok=True)
    return eval_entry.evaluate(cfg, out)


@pytest.mark.slow  # ~10 s: CI runs it, the quick lane leaves it
def test_the_suite_runs_end_to_end_and_writes_its_results(checkpoint, tmp_path: Path,
                                                           monkeypatch) -> None:
    out = tmp_path / "eval"
    results = run(config(checkpoint, "eval.write_inputs=true"), out, monkeypatch)
    ruler = results["ruler"]
    assert sorted(s["task"] for s in ruler["scores"]) == sorted(TASKS.strip("[]").split(","))
    assert all(s["samples"] == 2 and 0 <= s["score"] <= 100 for s in ruler["scores"])
    assert list(ruler["averages"]) == [str(LENGTH)]
    assert results["attention"]["kind"] == "dca"  # the checkpoint's own attention
    assert json.loads((out / "eval.json").read_text()) == results
    seconds = results["seconds"]
    assert {"data", "prompts", "load", "decoding", "engine.prefill", "engine.decode"} <= \
        set(seconds)
    assert seconds["engine.prefill"] + seconds["engine.decode"] <= seconds["decoding"]
    predictions = (out / "ruler_predictions.jsonl").read_text().splitlines()
    inputs = (out / "ruler_inputs.jsonl").read_text().splitlines()
    assert len(predictions) == len(inputs) == 8
    assert all(json.loads(r)["prompt_tokens"] <= LENGTH for r in inputs)
    assert (out / "ruler.png").stat().st_size > 0
    assert list((out / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_scores_and_effective_length_follow_the_predictions(checkpoint, tmp_path: Path,
                                                            monkeypatch) -> None:
    """A decoder that answers every reference scores 100 everywhere (effective length: the
    longest length); one that answers nothing scores 0 (none)."""
    def oracle(model, tokenizer, samples, options, progress=True, phases=None):
        return [" " + ", ".join(s.references) for s in samples]

    monkeypatch.setattr(ruler_run, "decode", oracle)
    results = run(config(checkpoint, f"eval.lengths=[{LENGTH},{2 * LENGTH}]"),
                  tmp_path / "a", monkeypatch)
    assert results["ruler"]["averages"] == {str(LENGTH): 100.0, str(2 * LENGTH): 100.0}
    assert results["ruler"]["effective_length"] == 2 * LENGTH
    monkeypatch.setattr(ruler_run, "decode",
                        lambda m, t, samples, o, p=True, phases=None: [""] * len(samples))
    results = run(config(checkpoint), tmp_path / "b", monkeypatch)
    assert results["ruler"]["averages"] == {str(LENGTH): 0.0}
    assert results["ruler"]["effective_length"] is None


@pytest.mark.parametrize(("override", "message"), [
    ("eval.tasks=[niah_single_1,nope]", "nope"),
    ("eval.threshold=0", r"\(0, 100\]"),
    ("eval.threshold=101", r"\(0, 100\]"),
    ("eval.samples=0", "eval.samples"),
])
def test_bad_suite_settings_are_one_error_before_the_checkpoint(tmp_path: Path, override: str,
                                                                message: str) -> None:
    cfg = compose_config([f"checkpoint.load={tmp_path / 'none'}", "eval.suite=ruler", override])
    with pytest.raises(UserError, match=message):
        validate_eval(cfg)


def test_a_qa_file_that_is_not_squad_shaped_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "qa.json"
    bad.write_text(json.dumps({"data": [{"title": "x"}]}))
    cfg = compose_config([f"checkpoint.load={tmp_path}", "eval.suite=ruler",
                          "eval.tasks=[qa_1]", f"eval.qa_file={bad}"])
    with pytest.raises(UserError, match="qa.json"):
        validate_eval(cfg)


@pytest.mark.slow
def test_a_length_too_short_for_a_task_is_one_line_before_the_model(checkpoint,
                                                                   tmp_path: Path) -> None:
    done = run_module(  # forked from the preloaded server (tests/conftest.py)
        "trainer.eval", [f"checkpoint.load={checkpoint}", "eval.suite=ruler", "eval.tasks=[vt]",
                         "eval.lengths=[300]", "trainer.device=cpu", "logger=none",
                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "vt at 300" in errors[0]
    assert "loaded" not in done.stderr


@pytest.mark.slow
def test_training_runs_the_suite_subset_at_its_eval_points(tmp_path: Path) -> None:
    """`eval.train_tasks` at every eval_interval, on one rank and shared by two data-parallel
    ranks (each decodes half the samples; the gathered scores are the same)."""
    from tests.conftest import FAST, train_on_ranks

    common = FAST + ["trainer.max_steps=4", "trainer.eval_interval=2", "+attention=dca",
                     "trainer.micro_batch_size=2",
                     # two tasks, fwe's 50 tokens to decode in place of niah's 128
                     "eval.train_tasks=[fwe,vt]", "eval.train_samples=3",
                     "eval.batch_size=2", f"eval.train_lengths=[{LENGTH}]"]
    one = train_on_ranks(common, tmp_path / "one")
    two = train_on_ranks(common, tmp_path / "two", nproc=2)
    for rows in (one, two):
        scored = [r for r in rows if "val_loss" in r]
        assert [r["step"] for r in scored] == [2, 4]
        assert all(0 <= r[f"ruler/{LENGTH}"] <= 100 and "ruler/effective_length" in r
                   for r in scored)
    assert [r[f"ruler/{LENGTH}"] for r in one if "val_loss" in r] == \
        [r[f"ruler/{LENGTH}"] for r in two if "val_loss" in r]
