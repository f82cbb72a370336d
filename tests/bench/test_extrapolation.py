"""bench/extrapolation.py's pieces that could fail silently: the tokenizer it trains must load as
the trainer loads it, and the table must read eval.json as trainer.eval writes it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import extrapolation  # noqa: E402
import extrapolation_corpus  # noqa: E402
import extrapolation_report  # noqa: E402
import pytest  # noqa: E402

from tests.module_runs import start_script  # noqa: E402


def test_trained_tokenizer_loads_with_the_trainers_loader_and_round_trips(tmp_path: Path) -> None:
    from trainer.data.datasets import embedded_corpus
    from trainer.data.tokenizer import load_tokenizer

    path = tmp_path / "tokenizer.json"
    extrapolation_corpus.embedded_tokenizer(path, 300, max_documents=3)
    tok = load_tokenizer(str(path))
    assert tok.vocab_size == 300
    assert tok.eod == tok._tok.token_to_id("<|endoftext|>")  # in the vocabulary, not appended
    text = embedded_corpus(max_documents=4)[3][1][:2000]  # a document it was not trained on
    ids = tok.encode(text)
    assert tok.eod not in ids and len(ids) < len(text.encode())  # merges learnt, no eod
    assert tok.decode(ids) == text


def _eval_json(trained: int) -> dict:
    """An eval.json as trainer.eval writes it, from its own dataclasses."""
    from trainer.evals.measures import AttentionPoint, PasskeyCell, PerplexityPoint, PositionBucket
    from trainer.evals.retrieval import MultiKeyCell

    passkey = [PasskeyCell(128, 0.0, 3, 4), PasskeyCell(128, 1.0, 1, 4),
               PasskeyCell(256, 0.0, 0, 4), PasskeyCell(256, 1.0, 2, 4)]
    multikey = [MultiKeyCell(128, 0.0, 1, 1, 2, 4), MultiKeyCell(128, 1.0, 2, 0, 2, 4),
                MultiKeyCell(256, 0.0, 0, 2, 2, 4), MultiKeyCell(256, 1.0, 0, 0, 2, 4)]
    points = [PerplexityPoint(128, 2.0, 1, [PositionBucket(0, 128, 2.0, 127)]),
              PerplexityPoint(256, 2.5, 1, [PositionBucket(0, 128, 2.0, 127),
                                            PositionBucket(128, 192, 3.0, 64),
                                            PositionBucket(192, 256, 4.0, 64)])]
    # two layers; 256: mass at distances [0, 128) and [128, 256)
    attention = [AttentionPoint(256, [128, 255], [0, 128], [2.0, 3.0], [[0.9, 0.1], [0.7, 0.3]])]
    from trainer.evals.results import EvalResults

    return EvalResults(checkpoint="c", step=0, trained_attention="standard", attention={},
                       label="standard+yarn(s=2,T0=128)", rope={}, trained_length=trained,
                       passkey=passkey, multikey=multikey, perplexity=points,
                       attention_by_distance=attention).to_dict()


def test_table_reads_eval_json(tmp_path: Path) -> None:
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(_eval_json(128)))
    rows = extrapolation_report.collect({"yarn": [path]})
    assert [(r["length"], r["multiple"]) for r in rows] == [(128, 1.0), (256, 2.0)]
    assert [r["passkey"] for r in rows] == [4 / 8, 2 / 8]
    assert [r["multikey"] for r in rows] == [3 / 4, 0.0]
    assert [r["multikey_distractor"] for r in rows] == [1 / 4, 2 / 4]
    assert rows[0]["ppl_beyond_T"] is None  # no position at or past T = 128
    assert math.isclose(rows[1]["ppl_beyond_T"], math.exp(3.5))  # 64 tokens at 3, 64 at 4
    assert rows[0]["attention_entropy"] is None  # 128 was not probed
    assert rows[1]["attention_entropy"] == 2.5 and math.isclose(rows[1]["attention_beyond_T"], 0.2)
    files = extrapolation_report.write(rows, tmp_path / "out", {"model": "tiny", "seq_length": 128})
    table = files[1].read_text()
    assert "| yarn |  | 2.50 / 0.200 |" in table
    assert "| yarn | 0.50 / 0.75 / 7.39 / — | 0.25 / 0.00 / 12.18 / 33.12 |" in table
    assert "256 (2T)" in table and "standard+yarn(s=2,T0=128)" in table
    assert json.loads(files[0].read_text())["rows"] == rows
    assert files[2].stat().st_size > 0


def test_the_report_rebuilds_from_eval_files(tmp_path: Path) -> None:
    """The CLI's report equals the driver's for the same eval.json files, keeps the meta it is
    given and says how it was made; a missing file is refused."""
    source = tmp_path / "eval.json"
    source.write_text(json.dumps(_eval_json(128)))
    expected = extrapolation_report.collect({"dca": [source], "yarn": [source]})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps({"meta": {"model": "m"}}))
    argv = ["--out", str(tmp_path / "out"), "--meta", str(tmp_path / "run" / "results.json"),
            f"dca={source}", f"yarn={source}"]
    extrapolation_report.main(argv)
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["rows"] == expected and [r["method"] for r in expected[:1]] == ["dca"]
    assert written["meta"]["model"] == "m" and "dca=" in written["meta"]["report_command"]
    with pytest.raises(SystemExit):
        extrapolation_report.main(["--out", str(tmp_path / "x"), f"dca={tmp_path / 'none'}"])


def test_smoke_arguments_stay_small() -> None:
    args = extrapolation.parse_args(["--smoke", "--out", "/tmp/x/out"])
    assert (args.model, args.seq, args.lengths) == ("tiny", 128, "1,2")
    assert args.work == Path("/tmp/x/out-work")
    assert list(extrapolation.evaluations(args)) == list(extrapolation.METHODS)
    none = extrapolation.parse_args(["--out", "/tmp/x/out", "--methods", "none"])
    assert extrapolation.evaluations(none) == {}


def test_a_training_cut_short_resumes_from_its_tracker(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(extrapolation, "run",
                        lambda module, overrides, log: calls.append(overrides))
    ckpt = tmp_path / "train" / "checkpoints"
    ckpt.mkdir(parents=True)
    base = ["model=tiny", "trainer.max_steps=10", "checkpoint.dir=elsewhere"]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    extrapolation.train(base, tmp_path / "train")
    assert f"checkpoint.load={ckpt}" in calls[-1] and "checkpoint.dir=elsewhere" not in calls[-1]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    extrapolation.train(base, tmp_path / "train")
    assert len(calls) == 1  # finished: reused, not run


@pytest.mark.slow  # the quick lane (-m 'not slow') leaves it to CI
def test_a_signal_stops_the_driver_after_its_training_saved(tmp_path: Path) -> None:
    """`timeout`'s SIGTERM reaches the driver and its training (one process group): the training
    saves the step it reached, the driver waits for it, starts nothing more and exits 143."""
    # `python bench/extrapolation.py ...` in a process group of its own (setsid), forked from
    # the preloaded server (tests/module_runs.py: without the ~8 s of a new interpreter's
    # imports); its training is the new interpreter the driver starts
    proc = start_script(extrapolation.ROOT / "bench" / "extrapolation.py",
                        ["--smoke", "--steps", "1000", "--out", str(tmp_path / "out")], tmp_path,
                        logs=tmp_path / "driver", new_session=True)
    metrics = tmp_path / "out-work" / "train" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(proc.output())
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` does: the driver and its training
        proc.wait(timeout=120)
    finally:  # whatever of its process group is left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(proc.output())
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM: rerun the same command to continue" in output
    tracker = tmp_path / "out-work" / "train" / "checkpoints" / "latest_checkpointed_iteration.txt"
    logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert int(tracker.read_text()) >= logged  # the step it reached, saved
    assert not (tmp_path / "out-work" / "eval").exists()  # nothing started after the stop


def test_side_by_side_yields_as_tasks_finish_and_a_failure_starts_nothing_more() -> None:
    started: list[str] = []

    def task(name: str, seconds: float, fail: bool = False):
        def run() -> str:
            started.append(name)
            time.sleep(seconds)
            if fail:
                sys.exit(f"{name} failed")
            return name
        return run

    slow_first = [task("slow", 1.0), task("fast", 0.0)]
    assert list(extrapolation.side_by_side(slow_first, 2)) == ["fast", "slow"]
    assert list(extrapolation.side_by_side(slow_first, 1)) == ["slow", "fast"]
    started.clear()
    finished: list[str] = []
    tasks = [task("bad", 0.0, fail=True), task("running", 1.0), task("next", 0.0)]
    with pytest.raises(SystemExit, match="bad failed"):
        finished += extrapolation.side_by_side(tasks, 2)
    assert sorted(started) == ["bad", "running"]  # "next" never started
    assert finished == ["running"]  # the running task's result still came


def test_corpus_dataset_validation_share_and_reuse(tmp_path: Path) -> None:
    """--corpus: the dataset holds the directory's files, the validation split holds what the
    evaluation needs (more than the default 5% would), and a rerun with other files is refused."""
    from trainer.build_data import main as build_main
    from trainer.data.datasets import build_datasets

    src = tmp_path / "src"
    for i in range(40):
        (src / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"pkg{i % 3}" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    (src / "skip.bin").write_text("not matched")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "z.py").write_text("z = 1\n")
    calls = []

    def run(module: str, argv: list[str], log: Path) -> None:
        calls.append(module)
        assert module == "trainer.build_data" and build_main(argv) == 0

    work = tmp_path / "work"
    work.mkdir()
    need = 3000
    corpus = extrapolation_corpus.build_corpus([src, extra], "*.py", work, 300, 0.002, None,
                                               need, run)
    assert (corpus.files, corpus.documents) == (41, 41)
    assert corpus.directories == [str(src.resolve()), str(extra.resolve())]
    assert 0 < corpus.tokenizer_files < 40 and corpus.tokenizer_bytes <= 2000  # the sample
    assert corpus.valid_fraction > extrapolation_corpus.DEFAULT_VALID_FRACTION
    _, valid, _ = build_datasets("indexed", corpus.prefix, str(work / "tokenizer.json"), 64,
                                 corpus.valid_fraction, seed=0)
    assert len(valid.stream) >= need
    extrapolation_corpus.count_epochs(corpus, work / "tokenizer.json", 64, 100, 0.5)
    assert corpus.valid_tokens == len(valid.stream) and corpus.epochs == 100 / corpus.train_samples
    assert "data.name=indexed" in corpus.overrides()

    again = extrapolation_corpus.build_corpus([src, extra], "*.py", work, 300, 0.002, None,
                                              need, run)
    assert calls == ["trainer.build_data"] and again.valid_fraction == corpus.valid_fraction
    with pytest.raises(SystemExit) as exc:  # other files into the same --work
        extrapolation_corpus.build_corpus([src], "*.py", work, 300, 0.002, None, need, run)
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # a directory inside another: files read twice
        extrapolation_corpus.build_corpus([src, src / "pkg1"], "*.py", tmp_path / "w2", 300,
                                          0.002, None, need, run)
    assert exc.value.code == 2 and calls == ["trainer.build_data"]


def test_wandb_runs_are_copied_beside_the_results(tmp_path: Path) -> None:
    """Offline runs of every training and evaluation go to OUT/wandb for `wandb sync`; a later
    copy brings the files a run wrote since."""
    work, out = tmp_path / "work", tmp_path / "out" / "wandb"
    first = work / "train" / "wandb" / "offline-run-20261123_1-a"
    second = work / "eval" / "dca" / "wandb" / "offline-run-20261123_2-b"
    for run in (first, second):
        (run / "files").mkdir(parents=True)
        (run / "run-x.wandb").write_text("1")
    (work / "train" / "wandb" / "debug.log").write_text("not a run")
    copies = extrapolation.copy_wandb_runs(work, out)
    assert sorted(p.name for p in copies) == [first.name, second.name]
    (second / "run-x.wandb").write_text("12")
    extrapolation.copy_wandb_runs(work, out)
    assert (out / second.name / "run-x.wandb").read_text() == "12"
    assert not (out / "debug.log").exists()
