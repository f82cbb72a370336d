"""Where the time goes in DCA's backward kernel in pieces (1/f of the query rows each): one
profiled fwd+bwd per row (bench.attention.profile), and the same calls timed back to back (the
host running ahead, as inside a model) against synchronised, beside FA4 causal attention.

    python3 docs/results/dca_backward_in_place_h100_2026-11-26/profile_pieces.py
"""

import argparse

from bench import attention as ba
from models.attention.dca import backward as dca_backward

for seq, kv_heads, fraction in ((32768, 16, 0), (32768, 16, 1), (32768, 16, 4), (32768, 16, 8),
                                (32768, 4, 8)):
    if fraction:
        dca_backward.rows_per_call = lambda tokens, f=fraction: tokens // f
        variant = ba.dca(8192, 1024, f"dca pieces 1/{fraction}", kernel="fa4", path="pieces")
    else:
        variant = ba.fa4()
    print(f"\n## {variant.name} at {seq}, 16/{kv_heads} heads")
    for back_to_back in (1, 5):
        args = argparse.Namespace(warmup=3, repeats=10, back_to_back=back_to_back)
        r = ba.measure(variant, seq, 16, kv_heads, 128, args)
        print(f"back to back {back_to_back}: fwd+bwd {r['fwd_bwd_ms']:.2f} ms, fwd "
              f"{r['fwd_ms']:.2f} ms, host {r['fwd_bwd_host_ms']:.2f} ms")
    print("\n".join(ba.profile(variant, seq, 16, kv_heads, 128).splitlines()[:22]), flush=True)
