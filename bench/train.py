"""End-to-end training throughput: tokens/s, TFLOP/s, MFU and peak memory per (model, attention, seq).

Each case is a real `trainer` run (same code path as `python -m trainer`) for a few steps in this
process; figures are medians over the steps after warm-up. Out-of-memory is reported, not fatal.

    python bench/train.py --models gpt_350m --attention standard dca --seqs 32768 \
        --steps 12 --warmup 4 --out bench_train.json [--set trainer.recompute=selective ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_module

from trainer.config import register_configs
from trainer.train import train


def run_case(model: str, attention: str, seq: int, steps: int, extra: list[str],
             run_dir: Path) -> list[dict[str, Any]]:
    """Train `steps` steps of one case; returns its metrics rows."""
    overrides = [
        f"model={model}", f"trainer.seq_length={seq}", "trainer.micro_batch_size=1",
        "trainer.global_batch_size=1", f"trainer.max_steps={steps}", "trainer.warmup_steps=1",
        "trainer.eval_interval=0", "checkpoint.save=false", "logger=none", "trainer.lr=3e-4",
        "trainer.min_lr=3e-5",
    ]
    if attention != "standard":
        overrides.append(f"+attention={attention}")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides + extra)
    train(cfg, run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    timed = rows[warmup:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops": statistics.median(r["tflops_per_gpu"] for r in timed),
        "mfu": statistics.median(r.get("mfu", float("nan")) for r in timed),
        "memory_gb": max(r["memory_gb"] for r in rows),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "timed_steps": len(timed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt_350m"])
    parser.add_argument("--attention", nargs="+", default=["standard", "dca"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--set", nargs="*", default=[], dest="extra",
                        help="extra Hydra overrides for every case")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    register_configs()

    results = []
    for model in args.models:
        for seq in args.seqs:
            for attention in args.attention:
                case = {"model": model, "attention": attention, "seq": seq}
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        rows = run_case(model, attention, seq, args.steps, args.extra, Path(tmp))
                    case.update(summarize(rows, args.warmup))
                except torch.OutOfMemoryError:
                    case["error"] = "OOM"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                results.append(case)
                print(json.dumps(case), flush=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, torch {torch.__version__}, overrides: {' '.join(args.extra) or '-'}\n")
    print("| model | attention | seq | tokens/s | TFLOP/s | MFU | peak GB | loss first→last |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['model']} | {r['attention']} | {r['seq']} | {r['error']} | | | | |")
            continue
        print(f"| {r['model']} | {r['attention']} | {r['seq']} | {r['tokens_per_s']:,.0f} | "
              f"{r['tflops']:.1f} | {100 * r['mfu']:.1f}% | {r['memory_gb']:.1f} | "
              f"{r['loss_first']:.2f}→{r['loss_last']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                        "overrides": args.extra, "results": results}, indent=1))


if __name__ == "__main__":
    main()
