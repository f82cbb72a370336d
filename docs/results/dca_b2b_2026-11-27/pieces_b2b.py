"""DCA (`auto`, C = 8192, w = 1024) against FA4 causal at 32K, by the backward's piece count,
timed two ways: synchronised samples (one call each, the host's issue time included where it
exceeds the GPU's) and back to back (5 calls per sample, the host queueing ahead as it does
layer after layer in a model). Each sample is a pair, FA4 causal then the variant, on the same
inputs; the ratio is FA4 causal's time over the variant's, median (min - max) of the pairs.
Peak memory: one fwd+bwd, above what was allocated before it.

    python3 docs/results/dca_b2b_2026-11-27/pieces_b2b.py [--repeats 10] [--kv-heads 16,4]
"""

import argparse
import statistics

import torch

from bench.attention import dca, fa4, fwd_bwd_step, inputs, time_ms
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
    """step with the backward in `count` even pieces (piece_rows' arguments: (seq) when this
    ran first, at d149e7a; (seq, heads, kv_heads) since)."""
    def run() -> object:
        saved = grouped.piece_rows
        grouped.piece_rows = lambda seq, *heads: -(-seq // count)
        try:
            with kernels.using("fa4"):
                return step()
        finally:
            grouped.piece_rows = saved
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
    peaks = {}
    for name, fn in (("fa4", base), *configs.items()):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - start) / 2**20
    for b2b in (int(x) for x in args.back_to_back.split(",")):
        pairs = {n: [] for n in configs}
        for _ in range(args.repeats):
            for n, fn in configs.items():
                pairs[n].append((time_ms(base, 0, 1, b2b)[0], time_ms(fn, 0, 1, b2b)[0]))
        for n, samples in pairs.items():
            ratios = [a / b for a, b in samples]
            print(f"{args.seq} 16/{kv} calls/sample {b2b} pieces {n}: FA4 causal "
                  f"{statistics.median(a for a, _ in samples):.2f} ms, DCA "
                  f"{statistics.median(b for _, b in samples):.2f} ms, ratio "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f}), "
                  f"peak {peaks[n]:.0f} MiB = {peaks[n] / peaks['fa4']:.2f}x FA4 causal's "
                  f"{peaks['fa4']:.0f}", flush=True)
