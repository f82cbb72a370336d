"""bench/quality.py end to end on the CPU at toy scale: a tiny Hugging Face model imported,
the training-free methods and a DCA fine-tune scored by the RULER-style suite, the results file,
table and plot written (GPU, real model: docs/experiments.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import quality
from tests.ckpt.hf_models import save_tokenizer

T = 512


@pytest.mark.slow  # ~1 minute: CI runs it, the quick lane leaves it
def test_the_quality_driver_runs_every_phase(tmp_path: Path) -> None:
    work, out, source = tmp_path / "work", tmp_path / "out", tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
        tie_word_embeddings=True)).save_pretrained(source)
    save_tokenizer(source)
    # fwe: a task whose prompts fit at T, with 50 tokens to generate (niah's 128 made the
    # untrained model's greedy decoding most of this test's time, ~27 s -> ~20 s on 2 cores)
    common = ["--work", str(work), "--out", str(out), "--cpu", "--tasks", "fwe",
              "--samples", "1", "--samples-main", "2", "--batch-size", "2"]
    for named in ([], ["--hf", str(source), "--gguf", str(source)]):  # none, or both
        with pytest.raises(SystemExit) as refused:
            quality.main(["prepare"] + named + common)
        assert refused.value.code == 2 and not work.exists()
    quality.main(["prepare", "--hf", str(source)] + common)
    assert (work / "ckpt").is_dir() and (work / "hf" / "tokenizer.json").exists()
    quality.main(["training-free"] + common + ["--plan", "dca,standard,yarn,dca_c=T"])
    quality.main(["finetune"] + common + ["--ft-steps", "2", "--ft-batch", "1"])
    # a method measured one length at a time is one line: standard again, at 8T only
    quality.main(["training-free"] + common + ["--plan", "standard", "--multiples", "8"])
    rows = json.loads((out / "quality.json").read_text())["rows"]
    # Qwen2.5-1M's split with the log scaling, at T only (its own results file): the split as
    # the plan sets it, the temperature from T on as the trainer adopts it
    quality.main(["training-free"] + common[:2] + ["--out", str(tmp_path / "out_1m")]
                 + common[4:] + ["--plan", "dca_log_1m", "--multiples", "1"])
    (row_1m,) = json.loads((tmp_path / "out_1m" / "quality.json").read_text())["rows"]
    assert (row_1m["attention"]["dca_chunk_size"], row_1m["attention"]["dca_local_size"],
            row_1m["attention"]["dca_scaling"], row_1m["attention"]["dca_scaling_floor_scale"]
            ) == (T, T // 32, "log", T)
    assert [r["method"] for r in rows] == ["dca", "standard", "yarn", "dca_c=T",
                                           "dca_finetuned_2T", "standard"]
    assert rows[5]["lengths"] == [8 * T]
    standard_line = next(line for line in (out / "quality.md").read_text().splitlines()
                         if line.startswith("| standard |"))
    cells = [c.strip() for c in standard_line.split("|")[2:-3]]
    assert cells == [f"{rows[1]['ruler']['averages'][str(m * T)]:.1f}" for m in (1, 2, 4)] + [
        f"{rows[5]['ruler']['averages'][str(8 * T)]:.1f}"]
    rows = rows[:5]
    assert rows[0]["attention"]["dca_chunk_size"] == 3 * T // 4  # the default split
    assert rows[0]["attention"]["dca_local_size"] == T // 16
    assert rows[3]["attention"]["dca_chunk_size"] == T
    assert rows[2]["rope"]["rope_scaling_type"] == "yarn"
    assert all(list(r["ruler"]["averages"]) == [str(T), str(2 * T), str(4 * T)] for r in rows)
    assert rows[0]["samples"] == 2 and rows[1]["samples"] == 1
    table = (out / "quality.md").read_text()
    assert table.count("\n") == 2 + len(rows) and "dca_finetuned_2T" in table
    assert table.splitlines()[0].endswith(f"| {8 * T:,} | effective | s |")
    assert (out / "quality.png").stat().st_size > 0
    assert quality.report([out / "quality.json"], out) == table
    # several runs' files: one table and one plot of all their rows, in order
    (tmp_path / "b").mkdir()
    other = tmp_path / "b" / "quality.json"
    other.write_text(json.dumps({"rows": [dict(rows[0], method="dca_again")]}))
    both = tmp_path / "both"
    merged = quality.report([out / "quality.json", other], both)
    assert merged.splitlines() == table.splitlines() + [table.splitlines()[2].replace(
        "| dca |", "| dca_again |")]
    assert (both / "quality.png").stat().st_size > 0


def _row(seed: int, length: int, scores: dict[str, tuple[float, int]], method: str = "yarn"):
    """A quality.json row of the RULER suite at one length: task -> (score, samples)."""
    cells = [{"task": t, "length": length, "score": s, "samples": n}
             for t, (s, n) in scores.items()]
    return {"method": method, "checkpoint": "W/ckpt", "label": "standard+yarn", "seed": seed,
            "lengths": [length], "samples": 6, "seconds": 10.0,
            "ruler": {"scores": cells, "threshold": 40.0, "effective_length": None,
                      "averages": {str(length): sum(s for s, _ in scores.values())
                                   / len(scores)}}}


def test_report_pools_seeds_and_joins_lengths(tmp_path: Path) -> None:
    """A length measured again with another seed pools each task's samples (weighted); another
    length joins the line; the same seed again is a line of its own."""
    rows = [_row(0, 8, {"a": (100.0, 6), "b": (0.0, 6)}),
            _row(1, 8, {"a": (50.0, 6), "b": (20.0, 4)}),
            _row(0, 16, {"a": (40.0, 6), "b": (40.0, 6)}),
            _row(0, 8, {"a": (0.0, 6), "b": (0.0, 6)})]
    (tmp_path / "quality.json").write_text(json.dumps({"rows": rows}))
    table = quality.report([tmp_path / "quality.json"], tmp_path / "out")
    pooled = ((100 * 6 + 50 * 6) / 12 + (0 * 6 + 20 * 4) / 10) / 2  # 37.5 + 8.0
    assert table.splitlines()[2:] == [f"| yarn | {pooled:.1f} | 40.0 | 8 | 30 |",
                                      "| yarn | 0.0 |  | - | 10 |"]
    (merged, again) = quality._merged(rows)
    assert merged["seeds"] == {"8": [0, 1], "16": [0]} and merged["lengths"] == [8, 16]
    assert merged["samples"] == {"8": 10, "16": 6} and again["samples"] == 6
    assert {(s["task"], s["length"]): s["samples"] for s in merged["ruler"]["scores"]} == {
        ("a", 8): 12, ("b", 8): 10, ("a", 16): 6, ("b", 16): 6}
    assert again["ruler"]["averages"] == {"8": 0.0} and rows[0]["ruler"]["scores"][0][
        "samples"] == 6  # the input rows are left as they were
