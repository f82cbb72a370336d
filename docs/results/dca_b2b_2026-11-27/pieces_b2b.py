"""DCA (`auto`, C = 8192, w = 1024) against FA4 causal at 32K, by the backward's piece count,
timed two ways: synchronised samples (one call each, the host's issue time included where it
exceeds the GPU's) and back to back (5 calls per sample, the host queueing ahead as it does
layer after layer in a model). Each sample is a pair, FA4 causal then the variant, on the same
inputs; the ratio is FA4 causal's time over the variant's, median (min - max) of the pairs.
Peak memory: one fwd+bwd, above what was allocated before it.

    python3 docs/results/dca_b2b_2026-11-27/pieces_b2b.py [--repeats 10] [--kv-heads 16,4]
"""

import argparse

import torch

from bench.attention import (
    alternating_samples,
    dca,
    describe_pairs,
    fa4,
    fwd_bwd_step,
    inputs,
    peak_mib,
    time_ms,
)
from models.attention import kernels
from models.attention.dca import grouped

parser = argparse.ArgumentParser()
parser.add_argument("--seq", type=int, default=32768)
parser.add_argument("--kv-heads", default="16,4")
parser.add_argument("--repeats", type=int, default=10)
parser.add_argument("--pieces", default="1,2,3,4,5")
parser.add_argument("--back-to-back", default="1,5")
args = parser.parse_args()


def with_pieces(step, count: int):  # noqa: ANN001, ANN202
    """step with the backward in `count` even pieces of rows, all heads at once (this ran at
    d149e7a and f4fccbc, patching grouped.piece_rows; since the backward's cut became
    grouped.split, the same cut through that)."""
    def run() -> object:
        saved = grouped.split
        grouped.split = lambda batch, seq, heads, kv_heads: grouped.Split(kv_heads,
                                                                           -(-seq // count))
        try:
            with kernels.using("fa4"):
                return step()
        finally:
            grouped.split = saved
    return run


print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
for kv in (int(x) for x in args.kv_heads.split(",")):
    problem = inputs(args.seq, 16, kv, 128)
    base = with_pieces(fwd_bwd_step(fa4(), problem), 5)
    variant = dca(8192, 1024, kernel="fa4")
    configs = {n: with_pieces(fwd_bwd_step(variant, problem), n)
               for n in (int(x) for x in args.pieces.split(","))}
    for fn in (base, *configs.values()):
        time_ms(fn, 3, 0)
    peaks = {name: peak_mib(fn) for name, fn in (("fa4", base), *configs.items())}
    for b2b in (int(x) for x in args.back_to_back.split(",")):
        pairs = alternating_samples(base, configs, 0, args.repeats, b2b)
        for n, samples in pairs.items():
            print(f"{args.seq} 16/{kv} calls/sample {b2b} pieces {n}: "
                  f"{describe_pairs(samples, 'FA4 causal', 'DCA')}, peak {peaks[n]:.0f} MiB = "
                  f"{peaks[n] / peaks['fa4']:.2f}x FA4 causal's {peaks['fa4']:.0f}", flush=True)
