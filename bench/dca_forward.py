"""DCA's forward kernel alone (models/attention/dca/fa4_forward.py, no rotation passes) against
FA4's causal forward, in alternating rounds on one GPU: the kernel with one part (the causal
loop, no query reloads), with three parts at the split a run uses (successive rows = w), and
with three parts and no shared successive rows (the most query reloads). The rotated queries are
random: the kernel's time does not depend on their values. Needs a Hopper GPU and FA4.

    python3 -m bench.dca_forward [--cases 32768:16:8192:1024,...] [--rounds 15] --out fwd.json

A case is seq:kv_heads:C:w (16 query heads of 128, batch 1); each round times every variant
once over `--back-to-back` calls, the order reversed every other round. The JSON holds each
case's median ms and FA4's median over each variant's (above 1: faster than FA4's forward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from bench.timing import time_ms
from models.attention.dca import fa4_forward
from models.attention.dca.plan import KERNEL_BLOCK
from models.attention.kernels import fa4_module

DEFAULT_CASES = "32768:16:8192:1024,32768:4:8192:1024,8192:16:2048:256,131072:16:8192:1024"


def variants(seq: int, kv_heads: int, chunk: int, local: int, heads: int = 16,
             dim: int = 128) -> dict[str, Callable[[], object]]:
    """The forward steps of one case: FA4 causal and DCA's kernel three ways."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = rand(1, seq, heads, dim), rand(1, seq, kv_heads, dim), rand(1, seq, kv_heads, dim)
    q_parts = rand(3, seq, heads, dim)  # [parts * b, s, h, d]: every part's rotated queries
    out = torch.empty_like(q)
    lse = torch.empty(1, heads, seq, device="cuda")
    scale = dim ** -0.5
    shared = -(-local // KERNEL_BLOCK) * KERNEL_BLOCK  # DCAPlan.successive_rows
    fa4 = fa4_module()
    return {
        "fa4_causal": lambda: fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True,
                                                  return_lse=True),
        "dca_one_part": lambda: fa4_forward.forward(q_parts[:1], k, v, scale, chunk, chunk,
                                                    out, lse),
        "dca": lambda: fa4_forward.forward(q_parts, k, v, scale, chunk, shared, out, lse),
        "dca_unshared": lambda: fa4_forward.forward(q_parts, k, v, scale, chunk, chunk, out,
                                                    lse),
    }


def measure(steps: dict[str, Callable[[], object]], rounds: int,
            back_to_back: int) -> dict[str, float]:
    """Median ms per call of each step over `rounds` alternating rounds."""
    for step in steps.values():
        time_ms(step, 3, 0)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in order:
            times[name].append(time_ms(steps[name], 0, 1, back_to_back)[0])
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="seq:kv_heads:C:w, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--back-to-back", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        seq, kv_heads, chunk, local = (int(x) for x in case.split(":"))
        # fewer calls per sample where one call takes ~0.1 s
        b2b = max(1, args.back_to_back * 32768 // seq) if seq > 32768 else args.back_to_back
        ms = measure(variants(seq, kv_heads, chunk, local), args.rounds, b2b)
        row = {"seq": seq, "heads": 16, "kv_heads": kv_heads, "chunk": chunk, "local": local,
               "back_to_back": b2b, "median_ms": ms,
               "fa4_over": {name: ms["fa4_causal"] / t for name, t in ms.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "argv": ["bench/dca_forward.py", *(argv if argv is not None else sys.argv[1:])],
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
