"""DCA's backward kernel in pieces of 1/f of the query rows (f = 1: one piece) against FA4
causal attention, in one process: fwd+bwd time (median of 10, synchronised) and peak memory.

    python3 docs/results/dca_backward_in_place_h100_2026-11-26/pieces_sweep.py
"""

import argparse

from bench import attention as ba
from models.attention.dca import backward as dca_backward

args = argparse.Namespace(warmup=3, repeats=10, back_to_back=1)
for seq, kv_heads in ((32768, 16), (32768, 4), (131072, 16)):
    causal = ba.measure(ba.fa4(), seq, 16, kv_heads, 128, args)
    print(f"| {seq} | 16/{kv_heads} | fa4 causal | {causal['fwd_bwd_ms']:.2f} | 1.00x | "
          f"{causal['peak_mib']:.0f} | 1.00x |", flush=True)
    for fraction in (1, 2, 4, 8, 16):
        dca_backward.rows_per_call = lambda tokens, f=fraction: tokens // f
        variant = ba.dca(8192, 1024, f"dca pieces 1/{fraction}", kernel="fa4", path="pieces")
        r = ba.measure(variant, seq, 16, kv_heads, 128, args)
        print(f"| {seq} | 16/{kv_heads} | 1/{fraction} | {r['fwd_bwd_ms']:.2f} | "
              f"{causal['fwd_bwd_ms'] / r['fwd_bwd_ms']:.3f}x | {r['peak_mib']:.0f} | "
              f"{r['peak_mib'] / causal['peak_mib']:.2f}x |", flush=True)
