"""DCA (C = 8192, w = 1024) against FA4 causal, with the successive part sharing the inter copy
past each chunk's first w rows (DCAPlan.successive_rows, as on this tree) and without (every
row its own successive copy, accumulator and zeroing, as before). Each sample: FA4 causal, then
both DCA forms, on the same inputs, 5 calls back to back (and synchronised single calls); the
ratio is FA4 causal's time over DCA's, median (min - max). Then a profile of one fwd+bwd of
each form (the passes around the kernels).

    python3 docs/results/dca_shared_2026-11-27/shared.py [--seqs 32768,131072] \
        [--kv-heads 16,4] [--repeats 10]
"""

import argparse

import torch

from bench.attention import dca, fa4, fwd_bwd_step, inputs, profile
from bench.timing import patched, print_pairs
from models.attention.dca import plan

parser = argparse.ArgumentParser()
parser.add_argument("--seqs", default="32768,131072")
parser.add_argument("--kv-heads", default="16,4")
parser.add_argument("--repeats", type=int, default=10)
parser.add_argument("--back-to-back", default="5,1")
parser.add_argument("--profile-seq", type=int, default=32768)
args = parser.parse_args()


def sharing(step, shared: bool):  # noqa: ANN001, ANN202
    """step with DCA's successive rows shared (the tree's plan) or not (a kernel block larger
    than any chunk: successive_rows = L, every row its own copy)."""
    return patched(step, plan, "KERNEL_BLOCK", plan.KERNEL_BLOCK if shared else 1 << 30)


print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
variant = dca(8192, 1024, kernel="fa4")
for seq in (int(s) for s in args.seqs.split(",")):
    for kv in (int(x) for x in args.kv_heads.split(",")):
        problem = inputs(seq, 16, kv, 128)
        base = sharing(fwd_bwd_step(fa4(), problem), True)
        forms = {f"successive {name}": sharing(fwd_bwd_step(variant, problem),
                                               name == "shared") for name in ("shared", "own")}
        print_pairs(base, forms, args.repeats, [int(x) for x in args.back_to_back.split(",")],
                    f"{seq} 16/{kv}")
        del problem, base, forms
        torch.cuda.empty_cache()
for shared in (True, False):
    plan.KERNEL_BLOCK = 128 if shared else 1 << 30
    print(f"\nprofile, successive {'shared' if shared else 'own'}:\n"
          + profile(variant, args.profile_seq, 16, 16, 128), flush=True)
plan.KERNEL_BLOCK = 128
