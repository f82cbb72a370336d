"""What a training run pays for its kernels' JIT compiles (FA4 compiles each kernel on first use).

Each case trains a few steps in its own process (bench/train.py), first with empty compile caches
(FA4's CuTe DSL cache, Triton's and Inductor's, in a fresh directory), then again with the caches
the first run filled, as a second run on the same machine finds them. Reported per run: the
process's wall time, the warm-up steps' own times (the first holds the compiles) and the median
step after them.

    python bench/first_use.py --cases standard:cudnn standard:fa4 dca:fa4 --seq 32768 \\
        --out first_use.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the compile caches a run fills on first use: FA4's (kernels.py turns it on), Triton's, Inductor's
CACHE_DIRS = {"FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "fa4", "TRITON_CACHE_DIR": "triton",
              "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def train_once(attention: str, kernel: str, args: argparse.Namespace, cache: Path,
               out: Path) -> tuple[float, dict[str, Any]]:
    """Wall seconds of one bench/train.py process, and its result row."""
    env = {**os.environ, **{var: str(cache / name) for var, name in CACHE_DIRS.items()}}
    command = [sys.executable, str(Path(__file__).with_name("train.py")), "--models", args.model,
               "--attention", attention, "--seqs", str(args.seq), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--set", *args.set,
               f"trainer.attention_kernel={kernel}", "--out", str(out)]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, json.loads(out.read_text())["results"][0]


def row(attention: str, kernel: str, caches: str, wall: float, result: dict[str, Any]) -> dict:
    first = result["warmup_steps_s"]
    return {"attention": attention, "kernel": kernel, "caches": caches, "process_s": wall,
            "warmup_steps_s": first, "step_s": result["step_s"],
            "first_step_extra_s": first[0] - result["step_s"]}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| attention (kernel) | compile caches | process s | warm-up steps s | step s after "
             "them | first step's extra s |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        steps = " / ".join(f"{t:.2f}" for t in r["warmup_steps_s"])
        lines.append(f"| {r['attention']} ({r['kernel']}) | {r['caches']} | "
                     f"{r['process_s']:.1f} | {steps} | {r['step_s']:.3f} | "
                     f"{r['first_step_extra_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["standard:cudnn", "standard:fa4",
                                                       "dca:fa4"], metavar="ATTENTION:KERNEL")
    parser.add_argument("--model", default="gpt_1p3b")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=["trainer.fused_norm=true",
                                                     "trainer.fused_rope=true", "logger=none"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for case in args.cases:
        attention, kernel = case.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            for caches in ("empty", "filled"):
                wall, result = train_once(attention, kernel, args, Path(tmp),
                                          Path(tmp) / f"{caches}.json")
                rows.append(row(attention, kernel, caches, wall, result))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model}, seq {args.seq}, {args.steps} steps, overrides: {' '.join(args.set)}\n")
    print(markdown(rows))
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
