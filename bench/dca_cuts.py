"""DCA (C = 8192, w = 1024) against FA4 causal, by how the backward kernel's work is cut
(grouped.Split): groups of key heads, pieces of query rows, or both. Each sample is a pair, FA4
causal then the cut, on the same inputs, one call each (synchronised) or 5 back to back; the
ratio is FA4 causal's time over the cut's, median (min - max) of the pairs. Peak memory: one
fwd+bwd, above what was allocated before it. Needs a Hopper GPU and FlashAttention-4.

    python3 -m bench.dca_cuts [--seq 32768] [--kv-heads 16,4] \
        [--cuts auto,16x1,16x5,3x1,4x1,2x1] [--repeats 10]

A cut "GxR": groups of at most G key heads, each group's rows in R pieces; "auto": grouped.split.
docs/benchmarks.md quotes its output ("How DCA's backward is cut"), and
tests/models/test_dca_grouped.py holds grouped.memory_over_causal to the peaks it printed.
"""

import argparse

import torch

from bench.attention import dca, fa4, fwd_bwd_step, inputs
from bench.timing import patched, print_pairs
from models.attention.dca import grouped

parser = argparse.ArgumentParser()
parser.add_argument("--seq", type=int, default=32768)
parser.add_argument("--kv-heads", default="16,4")
parser.add_argument("--cuts", default="auto,16x1,16x5,3x1,4x1,2x1")
parser.add_argument("--repeats", type=int, default=10)
parser.add_argument("--back-to-back", default="1,5")
args = parser.parse_args()


def with_cut(step, cut: str):  # noqa: ANN001, ANN202
    """step with the backward cut as `cut` says (GxR or auto)."""
    if cut == "auto":
        return patched(step, grouped, "split", grouped.split)
    group, pieces = (int(x) for x in cut.split("x"))

    def chosen(batch, seq, heads, kv, *accumulators):  # noqa: ANN001, ANN002, ANN202
        return grouped.Split(min(group, kv), -(-seq // pieces))
    return patched(step, grouped, "split", chosen)


print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
for kv in (int(x) for x in args.kv_heads.split(",")):
    problem = inputs(args.seq, 16, kv, 128)
    base = with_cut(fwd_bwd_step(fa4(), problem), "auto")
    variant = dca(8192, 1024, kernel="fa4")
    cuts = [c for c in args.cuts.split(",") if c == "auto" or int(c.split("x")[0]) <= kv]
    configs = {c: with_cut(fwd_bwd_step(variant, problem), c) for c in cuts}
    print(f"16/{kv}: auto is {grouped.split(1, args.seq, 16, kv)}", flush=True)
    print_pairs(base, {f"cut {c}": fn for c, fn in configs.items()}, args.repeats,
                [int(x) for x in args.back_to_back.split(",")], f"{args.seq} 16/{kv}")
