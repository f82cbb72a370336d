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

from bench.attention import (
    alternating_samples,
    dca,
    describe_pairs,
    fa4,
    fwd_bwd_step,
    inputs,
    peak_mib,
    profile,
    time_ms,
)
from models.attention import kernels
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
    block = plan.KERNEL_BLOCK

    def run() -> object:
        plan.KERNEL_BLOCK = block if shared else 1 << 30
        try:
            with kernels.using("fa4"):
                return step()
        finally:
            plan.KERNEL_BLOCK = block
    return run


print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
variant = dca(8192, 1024, kernel="fa4")
for seq in (int(s) for s in args.seqs.split(",")):
    for kv in (int(x) for x in args.kv_heads.split(",")):
        problem = inputs(seq, 16, kv, 128)
        base = sharing(fwd_bwd_step(fa4(), problem), True)
        forms = {name: sharing(fwd_bwd_step(variant, problem), name == "shared")
                 for name in ("shared", "own")}
        for fn in (base, *forms.values()):
            time_ms(fn, 3, 0)
        peaks = {name: peak_mib(fn) for name, fn in (("fa4", base), *forms.items())}
        for b2b in (int(x) for x in args.back_to_back.split(",")):
            pairs = alternating_samples(base, forms, 0, args.repeats, b2b)
            for name, samples in pairs.items():
                print(f"{seq} 16/{kv} calls/sample {b2b} successive {name}: "
                      f"{describe_pairs(samples, 'FA4 causal', 'DCA')}, peak "
                      f"{peaks[name] / peaks['fa4']:.2f}x FA4 causal's", flush=True)
        del problem, base, forms
        torch.cuda.empty_cache()
for shared in (True, False):
    plan.KERNEL_BLOCK = 128 if shared else 1 << 30
    print(f"\nprofile, successive {'shared' if shared else 'own'}:\n"
          + profile(variant, args.profile_seq, 16, 16, 128), flush=True)
plan.KERNEL_BLOCK = 128
