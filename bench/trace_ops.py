"""GPU time of a saved profiler trace by kernel, the operator that launched it and its input
shapes: where a step's elementwise time comes from (copies, casts, concatenations), which the
per-kernel categories of `bench/train.py --profile` do not say.

    python3 -m bench.trace_ops out/gpt_1p3b_standard_32768.json.gz --top 40

Traces come from `bench/train.py --profile ... --trace DIR` (Chrome format, operator shapes
recorded, gzipped or not). A kernel is charged to the innermost CPU operator with its
correlation id (torch's `External id`).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_EVENTS = ("kernel", "gpu_memset", "gpu_memcpy")


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def by_operator(events: list[dict[str, Any]]) -> list[tuple[str, str, str, float, int]]:
    """(kernel, operator, input shapes, GPU ms, launches), most time first."""
    operators: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {}):
            operators[e["args"]["External id"]].append(e)
    totals: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") not in GPU_EVENTS:
            continue
        launched_by = operators.get(e["args"].get("External id"), [])
        op = min(launched_by, key=lambda o: o["dur"]) if launched_by else None
        key = (e["name"], op["name"] if op else "?",
               str(op["args"].get("Input Dims", "")) if op else "")
        totals[key][0] += e["dur"] / 1e3
        totals[key][1] += 1
    rows = [(*key, ms, int(count)) for key, (ms, count) in totals.items()]
    return sorted(rows, key=lambda row: -row[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    print("| GPU ms | launches | kernel | operator | input shapes |")
    print("| --- | --- | --- | --- | --- |")
    for kernel, op, shapes, ms, count in by_operator(load(args.trace))[:args.top]:
        print(f"| {ms:.2f} | {count} | {kernel[:60]} | {op[:40]} | {shapes[:120]} |")


if __name__ == "__main__":
    main()
